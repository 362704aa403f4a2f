"""The dispatcher's side of queue mode: hold queued requests, release on grant.
Per dispatcher process, for every model (queue mode: ``queue.ttft_p99`` set):

* a controller tick (every ``_TICK`` s): one dispatcher at a time (a Redis
  lease) folds finished windows into the model's mode, grants queued requests
  up to the limit less the jobs in flight (``num_pending + num_ack_pending``
  of the model's consumers), expires the overdue; each refreshes its mode;
* the requests it queued stay unacked JetStream messages it holds (in-progress
  acks keep them from redelivery); a grant on ``<p>.grant.<dispatcher>``
  dispatches them, an expiry rejects them with 503 ``queue_timeout``;
* queued clients get their position (a Status QUEUED) whenever it changes;
* a request costs its reserved tokens over its tier's weight, waits its
  class's TTL; a lower class waits for spare slots, queue mode or not, and
  an interactive request that finds them full asks for a preemption.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgpack
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dispatcher.queueing import ModeState, QueueMode
from dispatcher.quota import QuotaUnavailable
from tidegate.apis import reservation
from tidegate.config import Config, ModelConfig, TierConfig
from tidegate.control.queue_stats import jobs_of
from tidegate.control.tenants import TenantTable
from tidegate.control.workers_registry import TTL as WORKER_TTL
from tidegate.control.workers_registry import WorkerInfo
from tidegate.telemetry import telemetry as tm
from tidegate.wire import classes
from tidegate.wire.protocol import Admission, ErrorInfo, Request, Status

log = logging.getLogger("tidegate.dispatcher")

_TICK = 0.25  # controller period, seconds
# Preempt asks whose budgets run out together (a burst's) share one read of
# the model's jobs, and one made within this long: under overload every
# interactive request asks, and each read is a round trip to JetStream.
_SHARED_READ = 0.05
_POSITIONS_EVERY = 2.0  # seconds between position updates to queued clients

Dispatch = Callable[[Request, Msg, dict[str, str], bool], Awaitable[None]]
Refund = Callable[[str], Awaitable[None]]


@dataclass(slots=True)
class Held:
    request: Request
    msg: Msg
    headers: dict[str, str]
    reserved: bool
    position: int = 0


class WorkerSlots:
    """Each live worker's slots per model, followed from ``<P>_WORKERS``
    (sans-I/O: the dispatcher feeds it ``on_put`` / ``on_delete``)."""

    def __init__(self) -> None:
        self._workers: dict[str, WorkerInfo] = {}

    def on_put(self, key: str, value: bytes) -> None:
        try:
            self._workers[key] = WorkerInfo.decode(value)
        except (ValueError, KeyError, TypeError, AttributeError):
            self._workers.pop(key, None)  # malformed: counts for nothing

    def on_delete(self, key: str) -> None:
        self._workers.pop(key, None)

    def of(self, model: str, now: float) -> int:
        """The model's slots on live workers that are not draining (0: none known)."""
        return sum(w.models[model].slots for w in self._workers.values()
                   if model in w.models and not w.draining and now - w.updated <= WORKER_TTL)


@dataclass(slots=True)
class QueueGate:
    config: Config
    nc: NATS
    js: JetStreamContext
    queue: QueueMode
    dispatch: Dispatch
    refund: Refund
    owner: str = field(default_factory=lambda: secrets.token_hex(6))
    tenants: TenantTable = field(default_factory=TenantTable)  # followed from <P>_TENANTS
    held: dict[str, Held] = field(default_factory=dict)
    modes: dict[str, ModeState] = field(default_factory=dict)
    backlog: dict[str, int] = field(default_factory=dict)
    workers: WorkerSlots = field(default_factory=WorkerSlots)  # followed from <P>_WORKERS
    # The model's free slots at the last tick (or read), less the jobs
    # dispatched since; absent: no worker known. At most 0: full, as far as
    # this dispatcher knows (a slot freed since is found by reading again,
    # :meth:`_full_now`). A burst dispatched within one tick finds it full.
    spare: dict[str, int] = field(default_factory=dict)
    _preempting: set[asyncio.Task[None]] = field(default_factory=set)  # preempt_for's timers
    _full_reads: dict[str, tuple[float, asyncio.Task[bool]]] = field(default_factory=dict)

    @property
    def grant_subject(self) -> str:
        return f"{self.config.nats.subject_prefix}.grant.{self.owner}"

    def models(self) -> list[ModelConfig]:
        """Every model: lower classes wait for spare capacity on each, and
        those with ``queue.ttft_p99`` also have queue mode."""
        return list(self.config.models)

    # -- admission ---------------------------------------------------------------

    async def admit(self, request: Request, msg: Msg, headers: dict[str, str],
                    model: ModelConfig, reserved: bool) -> bool:
        """True: dispatch now. False: the gate took the request (queued or
        answered it)."""
        mode = self.modes.get(model.name, ModeState())
        if not (mode.queueing or (self.backlog.get(model.name) and model.queue.ttft_p99 > 0)
                or (request.klass != classes.INTERACTIVE
                    and (self.backlog.get(model.name)
                         or (self.spare.get(model.name, 1) <= 0
                             and await self._full_now(model))))):
            return True
        now = time.time()
        # Never queued past the request's deadline (the edge gave up then).
        ttl = max(0.001, min(model.queue.ttl_for(request.klass),
                             request.deadline_ms / 1000 - now))
        try:
            state, position = await self.queue.enqueue(
                model.name, request.id, request.tenant, request.klass, self.owner,
                now, model.queue, cost=self.cost(request, model), ttl=ttl)
        except QuotaUnavailable as exc:
            # Without the shared queue, queueing cannot be fair or bounded:
            # run the request rather than lose it.
            log.warning("queue store unavailable (%s); admitting %s", exc, request.id)
            return True
        if state == "granted":
            return True
        if state in ("full", "expired", "displaced"):
            code = "queue_timeout" if state == "expired" else "queue_full"
            message = (f"The request waited longer than {ttl:g}s in the queue."
                       if state == "expired" else _full(model.name))
            await self._reject(request, msg, headers, code, message)
            return False
        self.held[request.id] = Held(request, msg, headers, reserved, position)
        await self.nc.publish(request.reply, Status(Admission.QUEUED, position,
                                                    headers=headers or None).encode())
        tm.get().metrics.dispatch_decisions.add(1, {tm.MODEL: model.name, tm.OUTCOME: "queued"})
        return False

    def cost(self, request: Request, model: ModelConfig) -> float:
        """A request's turns in the fair queue: the tokens it reserves (prompt
        estimate + its output cap), over its tenant's tier weight."""
        try:
            tokens = reservation(request.api, request.body, model.reserve_max_tokens)
        except Exception:  # a body a dialect cannot size: one turn, never a lost request
            tokens = 1
        return max(1, tokens) / self.weight(request.tenant)

    def weight(self, tenant: str) -> float:
        """The tenant's tier weight (1 without a tier)."""
        tier = self.tier(tenant)
        return tier.weight if tier is not None else 1.0

    def tier(self, tenant: str) -> TierConfig | None:
        """The tenant's tier: the one ``tidegate tenant set --tier`` named, if
        the config still has it, else the config's."""
        settings = self.tenants.get(tenant)
        if settings is not None and settings.tier:
            named = next((t for t in self.config.tiers if t.name == settings.tier), None)
            if named is not None:
                return named
        return self.config.tier_of(tenant)

    async def _reject(self, request: Request, msg: Msg, headers: dict[str, str], code: str,
                      message: str) -> None:
        tm.get().metrics.dispatch_decisions.add(1, {tm.MODEL: request.model, tm.OUTCOME: code})
        error = ErrorInfo(503, "service_unavailable", code, message, True, 5.0)
        await self.nc.publish(request.reply, Status(Admission.REJECTED, error=error,
                                                    headers=headers or None).encode())
        await msg.ack()
        await self.refund(request.id)

    # -- preemption ----------------------------------------------------------------

    def preempt_for(self, request: Request, model: ModelConfig) -> None:
        """A request was just dispatched. If it is interactive and found no
        free slot of its model (the last tick's spare, less the dispatches
        since), and the model is still full ``queue.preempt_after`` s later
        (read again then), a worker holding a batch line, a background
        response or a lighter tier's stream of the model is asked to hand
        one back (workers.preemption), once for this request; the ask
        carries the request's tier weight."""
        spare = self.spare.get(model.name)
        if spare is None:
            return  # no worker known: nothing to take a slot from
        self.spare[model.name] = spare - 1
        after = model.queue.preempt_after
        if request.klass != classes.INTERACTIVE or after <= 0 or spare > 0:
            return
        weight = self.weight(request.tenant)
        task = asyncio.get_running_loop().create_task(
            self._preempt_later(model, after, repr(weight).encode()))
        self._preempting.add(task)
        task.add_done_callback(self._preempting.discard)

    async def _preempt_later(self, model: ModelConfig, after: float, weight: bytes) -> None:
        await asyncio.sleep(after)
        try:
            if not await self._still_full(model):
                return  # a slot freed meanwhile
            await self.nc.publish(self.config.nats.subjects.preempt(model.name), weight)
        except Exception as exc:  # the request waits for a slot, as without preemption
            log.debug("could not ask for a preemption on %s: %s", model.name, exc)
            return
        tm.get().metrics.dispatch_decisions.add(1, {tm.MODEL: model.name,
                                                    tm.OUTCOME: "preempt_asked"})

    # -- grants ------------------------------------------------------------------

    async def on_grant(self, msg: Msg) -> None:
        for request_id, granted in msgpack.unpackb(msg.data):
            held = self.held.pop(request_id, None)
            if held is None:
                continue  # redelivered elsewhere meanwhile; its new owner gets it
            if granted:
                await self.dispatch(held.request, held.msg, held.headers, held.reserved)
            else:
                await self._reject(held.request, held.msg, held.headers, "queue_timeout",
                                   "The request waited longer than its queue TTL.")

    # -- loops ---------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Controller, positions and in-progress acks, until ``stop``."""
        models = self.models()
        if not models:
            return
        await self.nc.subscribe(self.grant_subject, cb=self.on_grant)
        last_positions = last_progress = time.monotonic()
        progress_every = self.config.dispatcher.ack_wait / 3
        paused: set[str] = set()
        while not stop.is_set():
            now = time.monotonic()
            for model in models:
                try:
                    await self._control(model)
                except QuotaUnavailable as exc:
                    # Once per outage, not per tick: every model has a gate.
                    if model.name not in paused:
                        paused.add(model.name)
                        log.warning("queue for %s paused (held requests wait, new ones "
                                    "run): %s", model.name, exc)
                else:
                    if model.name in paused:
                        paused.discard(model.name)
                        log.info("queue for %s resumed", model.name)
            if now - last_positions >= _POSITIONS_EVERY:
                last_positions = now
                await self._send_positions(models)
            if now - last_progress >= progress_every:
                last_progress = now
                for held in list(self.held.values()):
                    await held.msg.in_progress()
            await asyncio.sleep(_TICK)

    async def _control(self, model: ModelConfig) -> None:
        now = time.time()
        running = await self._running(model)
        slots = self.workers.of(model.name, now)
        self._count_spare(model.name, slots, running)
        if slots:
            tm.get().metrics.slots_spare.set(max(0, slots - running), {tm.MODEL: model.name})
        queue_mode = model.queue.ttft_p99 > 0
        if await self.queue.lead(model.name, self.owner, hold=_TICK * 4):
            state = (await self.queue.evaluate(model.name, running, now, model.queue)
                     if queue_mode else ModeState())
            if state.queueing:
                capacity = state.limit - running
            elif queue_mode:
                capacity = 1 << 30  # left queue mode: the queue goes in fair order
            else:  # lower classes only, on spare capacity (no slots known: let them go)
                capacity = slots - running if slots else 1 << 30
            grants = await self.queue.grant(model.name, capacity, now)
            if grants:
                by_owner: dict[str, list[tuple[str, bool]]] = {}
                for g in grants:
                    by_owner.setdefault(g.owner, []).append((g.request_id, g.granted))
                for owner, items in by_owner.items():
                    subject = f"{self.config.nats.subject_prefix}.grant.{owner}"
                    await self.nc.publish(subject, msgpack.packb(items))
        else:
            state = await self.queue.state(model.name) if queue_mode else ModeState()
        previous = self.modes.get(model.name)
        if previous is not None and previous.queueing != state.queueing:
            log.warning("model %s %s queue mode (p99 TTFT %.0f ms, limit %d)", model.name,
                        "entered" if state.queueing else "left", state.p99_ms, state.limit)
        self.modes[model.name] = state
        before = self.backlog.get(model.name)
        self.backlog[model.name] = await self.queue.queued(model.name)
        metrics, attrs = tm.get().metrics, {tm.MODEL: model.name}
        metrics.queue_mode.set(1 if state.queueing else 0, attrs)
        metrics.queue_mode_limit.set(state.limit if state.queueing else 0, attrs)
        if queue_mode or before or self.backlog[model.name]:
            for klass, n in (await self.queue.queued_by_class(model.name)).items():
                metrics.queue_mode_queued.set(n, {**attrs, tm.REQUEST_CLASS: klass})

    async def _still_full(self, model: ModelConfig) -> bool:
        """:meth:`_full_now`, one read shared by the asks within
        :data:`_SHARED_READ` of each other."""
        now = time.monotonic()
        read = self._full_reads.get(model.name)
        if read is None or now - read[0] > _SHARED_READ:
            read = self._full_reads[model.name] = (
                now, asyncio.get_running_loop().create_task(self._full_now(model)))
        return await read[1]

    async def _full_now(self, model: ModelConfig) -> bool:
        """Whether every slot of the model is taken, read again rather than
        from ``spare``: a slot freed since (a batch runner releases a line
        the moment one does) lets the request go now rather than at the next
        tick's grant."""
        slots = self.workers.of(model.name, time.time())
        running = await self._running(model)
        self._count_spare(model.name, slots, running)
        return 0 < slots <= running

    def _count_spare(self, model: str, slots: int, running: int) -> None:
        if slots:
            self.spare[model] = slots - running
        else:
            self.spare.pop(model, None)

    async def _running(self, model: ModelConfig) -> int:
        """Jobs admitted and not finished: waiting in the jobs stream or
        running, in the model's queue and each replica's (routing homes)."""
        return sum(await jobs_of(self.js, self.config, model))

    async def _send_positions(self, models: list[ModelConfig]) -> None:
        for model in models:
            mine = [h for h in self.held.values() if h.request.model == model.name]
            if not mine:
                continue
            try:
                positions = await self.queue.positions(model.name, [h.request.id for h in mine])
            except QuotaUnavailable:
                return
            for held, position in zip(mine, positions, strict=True):
                if position < 0 and self.held.pop(held.request.id, None) is not None:
                    # Granted or expired, but the grant message never came
                    # (core NATS is at most once): act on what Redis says.
                    if position == -1:
                        await self.dispatch(held.request, held.msg, held.headers, held.reserved)
                    elif position == -3:
                        await self._reject(held.request, held.msg, held.headers, "queue_full",
                                           _full(model.name))
                    else:
                        await self._reject(held.request, held.msg, held.headers,
                                           "queue_timeout",
                                           "The request waited longer than its queue TTL.")
                    continue
                if position and position != held.position:
                    held.position = position
                    await self.nc.publish(held.request.reply,
                                          Status(Admission.QUEUED, position).encode())


def _full(model: str) -> str:
    return (f"Model '{model}' is overloaded and its queue is full (a request of a lower "
            "class gives up its place to one of a higher class).")
