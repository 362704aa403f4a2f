"""Worker process: one pool of job slots per served model.

A worker pulls only for its free slots, so queued work stays in JetStream for
any worker. Slots are ``max_streams``, or, with ``"auto"``, what the model's
:class:`~workers.limiter.AdaptiveLimit` allows now.

Every job's Head names the worker's control subject; one subscription
demultiplexes the edges' acks and cancels, and ``<P>_CANCELS`` tombstones reach
the rest. Stop: no more pulls, in-flight jobs get ``worker.shutdown_timeout``,
then a job without output is handed back and one with output ends with a
retryable error. Every few seconds the slots go into ``<P>_WORKERS``
(``tidegate status``, routing) and the ``tidegate.worker.slots`` gauge.
Docs: docs/lifecycle.md#a-workers-job.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js import JetStreamContext

from tidegate.broker import bodies, broker, patient, poison
from tidegate.broker.kvwatch import wait_synced
from tidegate.broker.pull import Credit, Puller
from tidegate.config import Config, ModelConfig
from tidegate.control import provision, workers_registry
from tidegate.control.affinity import ensure_buckets as ensure_routing_buckets
from tidegate.control.prices import PriceBook, ensure_prices_bucket, watch_prices
from tidegate.control.workers_registry import ReplicaSlot, SlotInfo
from tidegate.errors import ProtocolError
from tidegate.telemetry import logs, tracing
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.untrusted import BadInput
from tidegate.wire.affinity import ROUTE_HEADER, prompt_chars
from tidegate.wire.cancels import CancelRegistry
from tidegate.wire.mux import Outbox, StoredOutbox, batch_limit
from tidegate.wire.protocol import (
    Ack,
    Attach,
    Cancel,
    Continue,
    Detach,
    Error,
    ErrorInfo,
    Request,
    Retransmit,
    UsageRecord,
    decode_control,
)
from workers.backends import Backend, create_backend
from workers.backends.load_probe import LoadProbe
from workers.fencing import FENCED, Fence
from workers.job import Job
from workers.job_context import JobContext, ack, dropped, resend, reserved
from workers.job_state import WORKER_SHUTDOWN
from workers.limiter import AdaptiveLimit
from workers.owners import ResponseOwners
from workers.preemption import Preemptions
from workers.replicas import Breaker, ReplicaSet
from workers.resumable import ResumableJob, ends_stored
from workers.routing import AT_HOME, Claim, LoadReporter, ReplicaPullers, WorkerRouting
from workers.tails import tails_for

log = logging.getLogger("tidegate.worker")
BAD_INPUT = BadInput("worker", log)
UNPROCESSABLE = ErrorInfo(400, "invalid_request_error", "unprocessable_request",
                          "The worker could not process this request (a field's type or value "
                          "is out of what it can handle); it was dropped.")

# Expiry of a replica's pull requests on its model's shared queue (seconds):
# the bound on how long in-flight may pass the replica's slots (see
# workers/routing.py).
SHARED_PULL_EXPIRES = 0.25


class Pool:
    """Slots, jobs and the control demux of one worker process."""

    def __init__(self, config: Config, ctx: JobContext) -> None:
        self.config = config
        self.ctx = ctx
        self.jobs: dict[str, Job] = {}
        # Ended jobs' unacked messages, for a retransmit that comes late; kept
        # as long as the edge waits before it gives up on a silent worker.
        self.tails = ctx.tails if ctx.tails is not None else tails_for(config)
        self.cancels = CancelRegistry(ttl=config.streams.max_age)
        self.pullers: list[Puller] = []
        self.by_model: dict[str, Puller] = {}
        # Models with several replicas: one group of pullers per replica.
        self.replicas: dict[str, dict[str, ReplicaPullers]] = {}
        self.routing: WorkerRouting | None = None
        self.load: LoadReporter | None = None
        self.limits: dict[str, AdaptiveLimit] = {}  # models with max_streams = "auto"
        # ... and per replica of a model with several: the limit is each backend's.
        self.replica_limits: dict[tuple[str, str], AdaptiveLimit] = {}
        # ... and its replicas' backends behind their breakers (failover).
        self.replica_sets: dict[str, ReplicaSet] = {}
        # Set when a limit moves: the registry heartbeat then goes out early,
        # so the batch runner (which fills exactly the advertised free slots)
        # sees a grown limit within a beat's spacing, not HEARTBEAT later.
        self.registry_wake = asyncio.Event()
        # Set by serve(): a worker cut from NATS runs no job (workers/fencing.py).
        self.fence: Fence | None = None
        self.preemption = Preemptions(ctx)  # background jobs that may give up their slot
        ctx.telemetry.metrics.observe_worker_slots(self._slot_observations)
        ctx.telemetry.metrics.observe_worker_limit(self._limit_observations)

    def breaker_changed(self, model: str) -> Callable[[], None]:
        """What a model's breakers call on a change: the registry entry and
        the load report go out now, so dispatchers stop routing there."""
        def changed() -> None:
            self.registry_wake.set()
            if self.load is not None:
                self.load.changed(model)
        return changed

    def slot_info(self, models: list[ModelConfig] | None = None) -> dict[str, SlotInfo]:
        """Slots and running jobs per served model (``models``: also those
        whose pull loop has not started yet)."""
        out = {m.name: SlotInfo(m.initial_streams * len(m.replicas) if len(m.replicas) > 1
                                else m.initial_streams, 0, m.adaptive) for m in models or ()}
        out.update({m: SlotInfo(p.capacity, p.busy, m in self.limits)
                    for m, p in self.by_model.items()})
        out.update({m: SlotInfo(sum(g.capacity for g in groups.values()),
                                sum(g.busy for g in groups.values()),
                                any((m, r) in self.replica_limits for r in groups))
                    for m, groups in self.replicas.items()})
        return out

    def replica_info(self) -> dict[str, dict[str, ReplicaSlot]]:
        return {m: {r: g.slot() for r, g in groups.items()}
                for m, groups in self.replicas.items()}

    def _limit_observations(self) -> list[tuple[float, tm.Attributes]]:
        out: list[tuple[float, tm.Attributes]] = [
            (float(p.capacity), {tm.MODEL: m, tm.SLOT_MODE: "auto" if m in self.limits
                                 else "fixed"}) for m, p in self.by_model.items()]
        out.extend((float(g.capacity), {tm.MODEL: m, tracing.REPLICA: r,
                                        tm.SLOT_MODE: "auto" if (m, r) in self.replica_limits
                                        else "fixed"})
                   for m, groups in self.replicas.items() for r, g in groups.items())
        return out

    def _slot_observations(self) -> list[tuple[float, tm.Attributes]]:
        out: list[tuple[float, tm.Attributes]] = []
        for model, info in self.slot_info().items():
            out.append((float(info.in_flight), {tm.MODEL: model, tm.SLOT_STATE: "used"}))
            out.append((float(info.free), {tm.MODEL: model, tm.SLOT_STATE: "free"}))
        return out

    async def on_presence(self, msg: Msg) -> None:
        """A presence probe (tidegate.broker.liveness). An empty one gets no
        answer (the requester's timeout says "alive"); another worker's names
        a request id and learns whether this worker runs its job (1), ended
        it lately (2: its tail is kept) or neither (0)."""
        if msg.data and msg.reply:
            request_id = msg.data.decode(errors="replace")
            await msg.respond(b"1" if request_id in self.jobs else
                              b"2" if self.tails.ended(request_id) else b"0")

    async def on_control(self, msg: Msg) -> None:
        if not msg.data:
            # An edge's liveness probe (tidegate.broker.liveness): being subscribed is the
            # whole answer; the server tells the edge when nobody is.
            return
        try:
            message = decode_control(msg.data)
        except ProtocolError as exc:
            BAD_INPUT.drop("control", "malformed", str(exc))
            return
        job = self.jobs.get(message.request_id)
        kind = type(message)
        if kind is Retransmit:
            await self._retransmit(job, message)  # type: ignore[arg-type]
            return
        if job is None:
            return
        if kind is Ack:
            job.on_ack(message.seq)  # type: ignore[union-attr]
        elif kind is Continue:
            job.on_continue(message)  # type: ignore[arg-type]
        elif kind is Cancel:
            job.cancel(message.reason)  # type: ignore[union-attr]
        elif isinstance(job, ResumableJob):
            # Readers of a resumable stream; other jobs have only their edge.
            if kind is Attach:
                job.on_attach(message.reader)  # type: ignore[union-attr]
            elif kind is Detach:
                job.on_detach(message.reader)  # type: ignore[union-attr]

    async def _retransmit(self, job: Job | None, message: Retransmit) -> None:
        if job is not None and not job.cancel_reason:
            await job.on_retransmit(message.seq)
            return
        # No running job, or one being cancelled (a second delivery its edge
        # dropped: the copy that ended here before it holds what was asked).
        tail = self.tails.since(message.request_id, message.seq)
        if tail is not None and tail[1]:
            log.info("job %s (ended): resending %d messages from seq %d",
                     message.request_id, len(tail[1]), message.seq)
            await resend(self.ctx, *tail)

    def on_cancel(self, request_id: str, reason: str) -> None:
        """A tombstone from the cancels bucket."""
        self.cancels.add(request_id)
        job = self.jobs.get(request_id)
        if job is not None:
            job.cancel(reason)

    async def _claimed_body(self, msg: Msg, request: Request) -> Request | None:
        """``request`` with its body read from the bodies' store
        (tidegate.broker.bodies); None when the job cannot run: the store is
        unreachable (handed back for another try) or the body is gone (the
        edge is told ``request_body_lost``, the reservation refunded)."""
        try:
            return await bodies.resolve(self.ctx.jetstream(), self.config, request)
        except bodies.BodyLost as exc:
            log.warning("job %s: %s", request.id, exc)
            await self.ctx.nc.publish(request.reply, Error(0, bodies.LOST).encode())
            await self.ctx.report(dropped(request, msg))
            await msg.ack()
        except bodies.BodyUnreadable as exc:  # no other try reads it better
            BAD_INPUT.drop("job", "invalid", str(exc))
            await msg.term()
        except Exception as exc:
            log.warning("job %s: its body could not be read (%s); handed back", request.id,
                        exc)
            await msg.nak(delay=1)
        return None

    async def run_job(self, msg: Msg, backend: Backend,
                      group: ReplicaPullers | None = None,
                      limit: AdaptiveLimit | None = None) -> None:
        try:
            request = Request.decode(msg.data)
        except ProtocolError as exc:
            BAD_INPUT.drop("job", "malformed", str(exc))
            await msg.term()
            return
        if self.fence is not None and self.fence.fenced:
            await msg.nak()  # cut from NATS: another worker takes it (if this gets out)
            return
        # This task is the job's: the binding ends with it.
        logs.bind(request.id, request.tenant, tracing.trace_id(request.extra))
        metrics = self.ctx.telemetry.metrics
        attempt = msg.metadata.num_delivered
        running = self.jobs.get(request.id)
        if (attempt > 1 and running is not None
                and running.msg.metadata.sequence.stream == msg.metadata.sequence.stream):
            # Delivered again while it runs here (its in-progress acks were
            # lost: DUPLICATE_DELIVERY): the running copy keeps it, and acks it.
            log.info("job %s delivered again (attempt %d) while it runs here; ignored",
                     request.id, attempt)
            return
        if attempt > 1:
            metrics.redeliveries.add(1, {tm.MODEL: request.model, tm.TIER: "worker"})
        expired = request.deadline_ms < time.time() * 1000
        if expired or request.id in self.cancels:
            log.info("dropping job %s: its client is gone", request.id)
            metrics.jobs.add(1, {tm.MODEL: request.model,
                                 tm.OUTCOME: "expired" if expired else "cancelled"})
            if not expired:
                metrics.cancellations.add(1, {tm.CAUSE: "before_start", tm.TIER: "worker"})
            # Nothing ran: the zero-token record refunds the reservation and
            # frees the concurrency slot.
            await self.ctx.report(dropped(request, msg))
            await ack(self.ctx, request, msg)
            return
        # A job answers on request.reply: only an edge inbox.
        if not request.reply or not self.config.nats.subjects.edge_inboxes(request.reply,
                                                                           request.mux):
            BAD_INPUT.drop("job", "bad_reply_subject", request.reply)
            await msg.term()
            return
        if group is not None and self.routing is not None:
            verdict = await self.routing.claim_within(msg, request.id,
                                                      self.config.worker.ack_wait)
            if verdict == Claim.DROP:
                log.info("dropping job %s: its other copy runs elsewhere", request.id)
                await msg.ack()
                return
            if verdict == Claim.RETRY:
                await msg.nak(delay=1)
                return
            await self.routing.note_home(msg, request.model, group.replica, group)
        if request.claim:
            resolved = await self._claimed_body(msg, request)
            if resolved is None:
                return
            request = resolved
        if group is not None:
            group.changed()
        try:
            job = (ResumableJob if request.resumable else Job)(msg, request, backend, self.ctx)
        except (ValueError, TypeError) as exc:
            BAD_INPUT.drop("job", "invalid", repr(exc))
            await msg.term()
            return
        job.limit = limit  # adaptive concurrency: this job's latency samples
        if group is not None:
            job.replicas, job.replica = self.replica_sets.get(group.model), group.replica
        self.jobs[request.id] = job
        self.preemption.started(job)
        if group is not None:
            group.started(request.id)
        if limit is not None:
            limit.acquire(time.monotonic())
        try:
            await job.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if poison.is_transient(exc):
                # Unacked: JetStream redelivers it (up to worker.max_deliver).
                log.exception("job %s failed", request.id)
            else:
                # The job itself is unprocessable: redelivering it fails the
                # same way. The edge gets an error, the quota its refund.
                await poison.terminate(msg, BAD_INPUT, "job", exc, self._fail_poison(job))
        finally:
            self.preemption.ended(job)
            if limit is not None:
                limit.release(time.monotonic())
            if group is not None:
                done = job.outcome == "done" and job.first_chunk_at
                # The prompt's length counts only away from home (a sample of
                # the prefill): one pass over its messages, only then.
                cold = (msg.headers or {}).get(ROUTE_HEADER) not in AT_HOME
                group.observe(request.id, job.first_chunk_at - job.started if done else None,
                              prompt_chars(request.body) if done and cold else 0, cold)
            # A second job with the same id (a replay) must not unregister the first.
            if self.jobs.get(request.id) is job:
                del self.jobs[request.id]
            self.tails.keep(job.request, job.window.kept())
            job.release()

    def _fail_poison(self, job: Job) -> poison.Answer:
        """Answer a job that raised: a final Error after what the edge has
        (the next seq), and a usage record that frees its reservation."""
        async def answer() -> None:
            request = job.request
            await job.abort(UNPROCESSABLE)
            await self.ctx.report(UsageRecord(
                id=request.id, model=request.model, outcome="error", tenant=request.tenant,
                user=request.user, key_id=request.key_id,
                attempt=job.msg.metadata.num_delivered, reserved=reserved(job.msg)))
        return answer

    async def pull(self, js: JetStreamContext, model: ModelConfig, backend: Backend,
                   stop: asyncio.Event) -> None:
        subjects = self.config.nats.subjects
        cfg = self.config.worker
        durable = await provision.worker_consumer(js, self.config, model)
        limit: AdaptiveLimit | None = None
        if model.adaptive:
            def resize(slots: int) -> None:
                log.debug("%s: concurrency limit %d -> %d", model.name, puller.capacity, slots)
                puller.resize(slots)
                self.registry_wake.set()

            limit = self.limits[model.name] = AdaptiveLimit(
                model.min_streams, model.max_streams_limit, tolerance=model.latency_tolerance,
                now=time.monotonic(), on_change=resize)
        # Credit = free slots: the puller never holds more jobs than this
        # worker can start at once.
        puller = Puller(self.ctx.nc, subjects.jobs_stream, durable,
                        lambda msg: self.run_job(msg, backend, limit=limit),
                        capacity=model.initial_streams, expires=cfg.fetch_timeout)
        self.pullers.append(puller)
        self.by_model[model.name] = puller
        log.info("worker serving %s (%s backend, %s slots)", model.name, model.backend,
                 f"auto, {model.min_streams}..{model.max_streams_limit}" if model.adaptive
                 else model.initial_streams)
        await puller.run(stop)

    def replica_group(self, model: ModelConfig, replica: str) -> ReplicaPullers:
        """The slots of one replica; created before the pull loops start, so
        the first registry heartbeat already names every replica served."""
        groups = self.replicas.setdefault(model.name, {})
        if replica not in groups:
            group = groups[replica] = ReplicaPullers(
                model.name, replica, model.initial_streams,
                on_change=self.load.changed if self.load is not None else None)
            if model.adaptive:
                def resize(slots: int) -> None:
                    log.debug("%s replica %s: concurrency limit %d -> %d", model.name, replica,
                              group.capacity, slots)
                    group.capacity = slots
                    self.registry_wake.set()
                    group.on_done()  # re-check both pullers' credit, report the load

                self.replica_limits[(model.name, replica)] = AdaptiveLimit(
                    model.min_streams, model.max_streams_limit,
                    tolerance=model.latency_tolerance, now=time.monotonic(), on_change=resize)
        return groups[replica]

    async def pull_replica(self, js: JetStreamContext, model: ModelConfig, replica: str,
                           backend: Backend, stop: asyncio.Event) -> None:
        """One replica of a model with several: its own queue (when routing is
        on) and the model's shared queue, on one set of slots."""
        subjects = self.config.nats.subjects
        cfg = self.config.worker
        group = self.replica_group(model, replica)
        limit = self.replica_limits.get((model.name, replica))

        async def handle(msg: Msg) -> None:
            await self.run_job(msg, backend, group, limit)

        consumers: list[tuple[str | None, Credit]] = [(None, group.shared_credit)]
        if self.routing is not None:
            consumers.append((replica, group.own_credit))
        for own, credit in consumers:
            durable = await provision.worker_consumer(js, self.config, model, own)
            # The shared queue's pull requests expire fast: those still out when
            # routed jobs fill the slots can deliver past the limit until then.
            expires = (min(cfg.fetch_timeout, SHARED_PULL_EXPIRES)
                       if credit == group.shared_credit and self.routing else cfg.fetch_timeout)
            # The credit function, not capacity, bounds these pullers: the
            # group's slots (its adaptive limit, or max_streams).
            puller = Puller(self.ctx.nc, subjects.jobs_stream, durable, handle,
                            capacity=model.streams_ceiling, expires=expires,
                            credit=credit, on_done=group.on_done)
            group.pullers.append(puller)
            self.pullers.append(puller)
        log.info("worker serving %s replica %s (%s slots, %s)", model.name, replica,
                 f"auto, {model.min_streams}..{model.max_streams_limit}" if model.adaptive
                 else model.initial_streams,
                 "own queue + shared" if self.routing else "shared queue")
        group.probe = LoadProbe(model.for_replica(replica).base_url, on_change=group.changed)
        if limit is not None:
            limit.backend_idle = group.probe.idle
        async with asyncio.TaskGroup() as tg:
            probe = tg.create_task(group.probe.run())
            await asyncio.wait([tg.create_task(p.run(stop)) for p in group.pullers])
            probe.cancel()

    @property
    def tasks(self) -> set[asyncio.Task[None]]:
        """Every job task of every model."""
        return set().union(*(p.tasks for p in self.pullers))

    async def drain(self, grace: float) -> None:
        if not self.tasks:
            return
        log.info("waiting up to %.0fs for %d in-flight jobs", grace, len(self.tasks))
        _, pending = await asyncio.wait(set(self.tasks), timeout=grace)
        if not pending:
            return
        log.warning("ending %d jobs still running after %.0fs", len(pending), grace)
        for job in list(self.jobs.values()):
            job.cancel(WORKER_SHUTDOWN)
        _, pending = await asyncio.wait(pending, timeout=5.0)
        for task in pending:  # not even the cancel completed: leave them to redelivery
            task.cancel()


async def serve(config: Config, stop: asyncio.Event) -> None:
    worker_id = secrets.token_hex(6)
    subjects = config.nats.subjects
    index = config.model_index()
    wanted = config.worker.models
    models = [m for m in config.models if not wanted or any(index[n] is m for n in wanted)]

    started = time.time()
    pools: list[Pool] = []  # the pool, once made: the fence stops its jobs

    def stop_jobs(why: str) -> None:
        for job in [j for p in pools for j in p.jobs.values()]:
            job.cancel(FENCED)

    def resend_all() -> None:
        # Back on NATS (a reconnect, to another node after one's death):
        # whatever was in flight through the lost connection, output to edges
        # and their acks back, may be gone. Every job sends its unacked
        # messages again (edges drop what they have, and ack again on seeing
        # a copy), so no stream waits for an edge's silence rule to ask.
        for job in [j for p in pools for j in p.jobs.values()]:
            task = asyncio.get_running_loop().create_task(job.on_retransmit(0))
            resends.add(task)  # held until done: the loop keeps only a weak reference
            task.add_done_callback(resends.discard)

    resends: set[asyncio.Task[None]] = set()

    fence = Fence(stop_jobs, resend_all)
    nc = await broker.connect(config.nats, f"tidegate-worker-{worker_id}", stop,
                              on_link=fence.on_link)
    js = broker.jetstream(nc, config.nats)
    await broker.ensure_streams(js, config)
    await bodies.ensure(js, config)  # claimed bodies are read and deleted here
    outbox = None
    if config.worker.coalesce_bytes:
        outbox = Outbox(nc.publish,
                        batch_limit(config.worker.coalesce_bytes, nc.max_payload),
                        config.worker.coalesce_delay)
        outbox.start()
    # Resumable streams' log entries: batched even with coalescing off, and
    # stored before the next batch of a log goes (StoredOutbox).

    async def store(subject: str, payload: bytes, msg_id: str) -> None:
        await patient.publish(js, nc, subject, payload, {"Nats-Msg-Id": msg_id},
                              config.edge.publish_patience)

    log_outbox = StoredOutbox(store, batch_limit(128 << 10, nc.max_payload))
    log_outbox.start()
    prices = PriceBook(config)
    prices_kv = await ensure_prices_bucket(js, config)
    owners = ResponseOwners(await broker.ensure_owners_bucket(js, config),
                            config.nats.request_timeout)
    ctx = JobContext(config=config, nc=nc, control_subject=subjects.control(worker_id),
                     outbox=outbox, log_outbox=log_outbox, prices=prices,
                     tails=tails_for(config), owners=owners, js=js)
    pool = Pool(config, ctx)
    pool.fence = fence
    pools.append(pool)
    await nc.subscribe(ctx.control_subject, cb=pool.on_control)
    # Presence (tidegate.broker.liveness): while this connection lives, "no
    # responders" never comes back.
    await nc.subscribe(subjects.presence(worker_id), cb=pool.on_presence)
    # Retransmits from an edge that lost a Head (it cannot know the worker).
    await nc.subscribe(subjects.retransmit_any, cb=pool.on_control)
    cancels = await broker.ensure_cancels_bucket(js, config)
    registry = await workers_registry.ensure_bucket(js, config)

    replicated = [m for m in models if len(m.replicas) > 1]
    if replicated and config.routing.affinity == "auto":
        homes, claims = await ensure_routing_buckets(js, config)
        pool.routing = WorkerRouting(nc, homes, claims, subjects.affinity_bucket)
        pool.load = LoadReporter(nc, subjects, worker_id,
                                 lambda model: pool.replicas.get(model, {}))

    def beat() -> workers_registry.WorkerInfo:
        return workers_registry.local_info(worker_id, started, pool.slot_info(models),
                                           draining=stop.is_set(),
                                           replicas=pool.replica_info())

    backends = {m.name: create_backend(m, config.worker) for m in models
                if len(m.replicas) <= 1}
    served = config.worker.replicas
    replica_backends = {(m.name, r): create_backend(m.for_replica(r), config.worker)
                        for m in replicated for r in m.replica_names
                        if not served or r in served}
    for (m, r), backend in replica_backends.items():
        group = pool.replica_group(index[m], r)
        group.breaker = Breaker()
        pool.replica_sets.setdefault(m, ReplicaSet(on_change=pool.breaker_changed(m),
                                                   failover=index[m].failover)).add(
            r, backend, group.breaker)
    try:
        # The pull loops are owned by this TaskGroup and end at stop; jobs are
        # tracked by the pool, since they must outlive the pull loops to drain.
        async with asyncio.TaskGroup() as tg:
            heartbeat = tg.create_task(workers_registry.heartbeat(registry, beat,
                                                                  wake=pool.registry_wake))
            fencing = tg.create_task(fence.watch(nc))
            reporter = tg.create_task(pool.load.run()) if pool.load is not None else None
            watcher = await broker.follow_cancels(tg, cancels, pool.on_cancel,
                                                  config.nats.request_timeout, "worker")
            # Pull only once the stored prices are loaded, so no job is
            # costed at a price the operator already replaced.
            prices_synced = asyncio.Event()
            price_watch = tg.create_task(watch_prices(prices_kv, prices,
                                                      on_synced=prices_synced.set))
            await wait_synced(prices_synced, config.nats.request_timeout, "worker: prices")
            pullers = [tg.create_task(pool.pull(js, m, backends[m.name], stop))
                       for m in models if m.name in backends]
            pullers += [tg.create_task(pool.pull_replica(js, index[m], r, backend, stop))
                        for (m, r), backend in replica_backends.items()]
            await stop.wait()
            if pool.load is not None:
                pool.load.draining = True  # dispatchers stop routing here at once
                for model in pool.replicas:
                    pool.load.changed(model)
            # Each pull loop ends at stop once its open pull requests are
            # spent, a job they still deliver going to another worker
            # (tidegate.broker.pull); cancelled if it overstays.
            if pullers:
                await asyncio.wait(pullers, timeout=config.worker.fetch_timeout + 2.0)
            for puller in pullers:
                puller.cancel()
            await pool.drain(config.worker.shutdown_timeout)
            await ends_stored(config.edge.publish_patience)  # the last logs' ends
            watcher.cancel()
            price_watch.cancel()
            fencing.cancel()
            heartbeat.cancel()  # deletes this worker's entry
            if reporter is not None:
                reporter.cancel()
    finally:
        for backend in [*backends.values(), *replica_backends.values()]:
            await backend.aclose()
        await log_outbox.close()  # the last jobs' Done and Error messages (and log entries)
        if outbox is not None:
            await outbox.close()
        await broker.close(nc)
        log.info("worker %s stopped", worker_id)
