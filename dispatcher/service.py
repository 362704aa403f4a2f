"""Dispatcher process: pull requests, decide, publish jobs.

Invariant: a request message is acked only after its job is published (or it
is dropped on purpose: expired, cancelled, malformed). A dispatcher killed at
any point loses nothing: JetStream redelivers the unacked request after
``dispatcher.ack_wait``, and the job publish is deduplicated by ``Nats-Msg-Id``
(the request id) within the jobs stream's duplicate window, so a request
dispatched twice still runs once.

Any number of dispatchers share one durable pull consumer; JetStream spreads
requests between them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dispatcher.admission import AdmissionPolicy, QuotaAdmission
from dispatcher.batch import runner as batch
from dispatcher.gate import QueueGate
from dispatcher.queueing import QueueMode
from dispatcher.quota import QuotaStore, QuotaUnavailable
from dispatcher.quota import connect as connect_quota_store
from dispatcher.redis_client import preload_scripts
from dispatcher.routing import ReplicaView, Router
from tidegate import apis
from tidegate.broker import bodies, broker, poison
from tidegate.broker.kvwatch import follow_bucket, wait_synced
from tidegate.broker.pull import Puller
from tidegate.config import Config
from tidegate.control import provision, workers_registry
from tidegate.control.affinity import ensure_buckets as ensure_routing_buckets
from tidegate.control.budgets import BudgetSet, ensure_budgets_bucket, watch_budgets
from tidegate.control.policies import PolicySet, ensure_policies_bucket, watch_policies
from tidegate.control.prices import PriceBook, ensure_prices_bucket, watch_prices
from tidegate.control.tenants import ensure_tenants_bucket, watch_tenants
from tidegate.errors import ProtocolError
from tidegate.telemetry import logs, tracing
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.untrusted import BadInput
from tidegate.wire import classes
from tidegate.wire.cancels import CancelRegistry
from tidegate.wire.protocol import (
    RESERVED_HEADER,
    Admission,
    ErrorInfo,
    Request,
    Status,
    UsageRecord,
)

log = logging.getLogger("tidegate.dispatcher")
BAD_INPUT = BadInput("dispatcher", log)
UNPROCESSABLE = ErrorInfo(400, "invalid_request_error", "unprocessable_request",
                          "The gateway could not process this request (a field's type or "
                          "value is out of what it can handle); it was dropped.")


class Dispatcher:
    def __init__(self, config: Config, nc: NATS, js: JetStreamContext,
                 policy: AdmissionPolicy) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.policy = policy
        self.subjects = config.nats.subjects
        self.cancels = CancelRegistry(ttl=config.streams.max_age)
        self.models = config.model_index()
        self.gate: QueueGate | None = None  # the fair queue (dispatcher.gate); None in unit tests
        self.router: Router | None = None  # set when a model has several replicas
        self.metrics = tm.get().metrics

    def on_cancel(self, request_id: str, reason: str) -> None:
        self.cancels.add(request_id)

    async def handle_safely(self, msg: Msg) -> None:
        """Handle one request. A transient failure (NATS, Redis) leaves it
        unacked, so it is redelivered; any other failure is the message's own
        (``tidegate.broker.poison``): the edge gets a 400 and the message is
        terminated, so it can neither crash this tier nor come back forever."""
        try:
            await self.handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if poison.is_transient(exc, (QuotaUnavailable,)):
                # Left for redelivery: the next copy reuses any reservation
                # (reserving an id already charged admits it without a charge).
                log.exception("dispatching failed; the request will be redelivered")
                return
            request = _decoded(msg)
            await poison.terminate(msg, BAD_INPUT, "request", exc, self._reject_poison(request))
            # Terminated before its job was published (dispatch never raises
            # poison after it): it will never run, so nothing else refunds it.
            if request is not None:
                await self.policy.refund(request.id)

    def _reject_poison(self, request: Request | None) -> poison.Answer | None:
        """The 400 for an unprocessable request, when it names an edge inbox."""
        if (request is None or not request.reply
                or not self.config.nats.subjects.edge_inboxes(request.reply)):
            return None
        status = Status(Admission.REJECTED, error=UNPROCESSABLE)

        async def answer() -> None:
            await self.nc.publish(request.reply, status.encode())
        return answer

    async def handle(self, msg: Msg) -> None:
        try:
            request = Request.decode(msg.data)
        except ProtocolError as exc:
            # Redelivering a message nobody can read helps no one.
            BAD_INPUT.drop("request", "malformed", str(exc))
            await msg.term()
            return
        # The dispatcher answers on request.reply: only an edge inbox.
        if not request.reply or not self.config.nats.subjects.edge_inboxes(request.reply,
                                                                           request.mux):
            BAD_INPUT.drop("request", "bad_reply_subject", request.reply)
            await msg.term()
            return
        # Each message runs in its own task (tidegate.pull), so the log
        # context needs no reset.
        logs.bind(request.id, request.tenant, tracing.trace_id(request.extra))
        if msg.metadata.num_delivered > 1:
            self.metrics.redeliveries.add(1, {tm.MODEL: request.model, tm.TIER: "dispatcher"})
        with tracing.dispatch_span(tm.get(), msg.headers, request,
                                   apis.of(request.api).operation):
            await self._decide(request, msg)

    async def _decide(self, request: Request, msg: Msg) -> None:
        if request.deadline_ms < time.time() * 1000:
            log.info("dropping request %s: its deadline passed while queued", request.id)
            self.metrics.dispatch_decisions.add(1, {tm.MODEL: request.model,
                                                    tm.OUTCOME: "expired"})
            await self._drop(request, msg)
            return
        if request.id in self.cancels:
            log.info("dropping request %s: cancelled by the client", request.id)
            self.metrics.cancellations.add(1, {tm.CAUSE: "before_dispatch",
                                               tm.TIER: "dispatcher"})
            await self._drop(request, msg)
            return

        if request.claim:  # its body is in the bodies' store (tidegate.broker.bodies)
            try:
                request = await bodies.resolve(self.js, self.config, request)
            except bodies.BodyLost as exc:
                log.warning("rejecting request %s: %s", request.id, exc)
                await self.nc.publish(request.reply, Status(
                    Admission.REJECTED, error=bodies.LOST).encode())
                await msg.ack()
                return
        decision = await self.policy.admit(request)
        if decision.admission is Admission.REJECTED:
            self.metrics.dispatch_decisions.add(1, {tm.MODEL: request.model,
                                                    tm.OUTCOME: "rejected"})
            status = Status(decision.admission, decision.position, decision.error,
                            headers=decision.headers or None)
            await self.nc.publish(request.reply, status.encode())
            await msg.ack()
            return
        model = self.models.get(request.model)
        if (self.gate is not None and model is not None
                and not await self.gate.admit(request, msg, decision.headers, model,
                                              decision.reserved)):
            return  # queued (held until granted) or answered by the gate
        await self.dispatch(request, msg, decision.headers, decision.reserved)

    async def _drop(self, request: Request, msg: Msg) -> None:
        """Ack a request that will not run. A redelivered one may hold the
        reservation an earlier delivery made before failing transiently: it
        is refunded (a first delivery reserved nothing, so Redis is spared)."""
        if msg.metadata.num_delivered > 1:
            await self.policy.refund(request.id)
        await msg.ack()

    async def dispatch(self, request: Request, msg: Msg, headers: dict[str, str],
                       reserved: bool) -> None:
        """Publish the job, then ack the request: the order that loses nothing.

        Once the job is published its worker's usage reconciles the
        reservation, so nothing after it may end as poison (which refunds):
        a failure there is logged and the request left for redelivery, whose
        job JetStream deduplicates (``Nats-Msg-Id``)."""
        await self.nc.publish(request.reply, Status(Admission.ADMITTED,
                                                    headers=headers or None).encode())
        subject = self.subjects.job(request.model)
        job_headers = {"Nats-Msg-Id": request.id,
                       **({RESERVED_HEADER: "1"} if reserved else {}),
                       **tracing.job_headers(msg.headers)}
        weight = self.gate.weight(request.tenant) if self.gate is not None else 1.0
        if weight != 1.0:  # a lighter tier's stream may give way to a heavier's
            job_headers[classes.WEIGHT_HEADER] = repr(weight)
        model = self.models.get(request.model)
        routed = None
        if self.router is not None and model is not None and self.router.applies(model):
            routed = await self.router.route(request, model)
            subject = routed.subject
            job_headers.update(routed.headers)
            tracing.set_route(routed.route.replica, str(routed.route.reason))
        try:
            await self.js.publish(subject, msg.data, headers=job_headers)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not publish job for %s (%s); will retry", request.id, exc)
            await msg.nak(delay=1)
            return
        try:
            await msg.ack()
            if (self.router is not None and routed is not None
                    and routed.route.replica is not None):
                self.router.schedule_fallback(request, msg.data, job_headers, routed)
            self.metrics.dispatch_decisions.add(1, {tm.MODEL: request.model,
                                                    tm.OUTCOME: "admitted"})
            if self.gate is not None and model is not None:
                self.gate.preempt_for(request, model)
        except Exception as exc:
            if poison.is_transient(exc):
                raise
            log.exception("after publishing the job for %s; the request is left for "
                          "redelivery", request.id)
            return
        log.debug("dispatched %s to %s", request.id, subject)


def _decoded(msg: Msg) -> Request | None:
    """The request ``msg`` carries, None when it does not decode."""
    try:
        return Request.decode(msg.data)
    except Exception:
        return None


class Reconciler:
    """Settles every reservation with the actual usage workers report.

    Shared by all dispatchers through one durable consumer. A record is acked
    only once the store applied it; reconcile is idempotent, so a redelivery
    after a crash does no harm. TTFT samples feed queue mode."""

    def __init__(self, store: QuotaStore, queue: QueueMode, config: Config) -> None:
        self.store = store
        self.queue = queue
        self.models = config.model_index()

    async def handle(self, msg: Msg) -> None:
        try:
            record = UsageRecord.decode(msg.data)
        except ProtocolError as exc:
            BAD_INPUT.drop("usage", "malformed", str(exc))
            await msg.term()
            return
        try:
            if record.reserved:
                await self.store.reconcile(record.id,
                                           record.prompt_tokens + record.completion_tokens,
                                           actual_money=record.cost_nanos)
            model = self.models.get(record.model)
            if model is not None and model.queue.ttft_p99 > 0 and record.ttft_ms > 0:
                await self.queue.record_ttft(model.name, record.ttft_ms, time.time(), model.queue)
        except QuotaUnavailable as exc:
            log.warning("cannot reconcile %s yet: %s", record.id, exc)
            await msg.nak(delay=2)
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if poison.is_transient(exc):
                log.exception("reconciling %s failed; it will be redelivered", record.id)
                return
            await poison.terminate(msg, BAD_INPUT, "usage", exc)  # nobody waits for an answer
            return
        await msg.ack()


async def serve(config: Config, stop: asyncio.Event) -> None:
    cfg = config.dispatcher
    subjects = config.nats.subjects
    nc = await broker.connect(config.nats, "tidegate-dispatcher", stop)
    js = broker.jetstream(nc, config.nats)
    await broker.ensure_streams(js, config)
    await bodies.ensure(js, config)  # claimed bodies are read here (admission)
    await provision.dispatcher_consumers(js, config)

    # The client reconnects by itself: a Redis restart needs no dispatcher
    # restart, and while it is down QuotaAdmission fails open or closed.
    redis_client = connect_quota_store(config.redis.url, config.redis.timeout)
    store = QuotaStore(redis_client, prefix=config.nats.subject_prefix,
                       lease=config.edge.request_timeout)
    policies = PolicySet()
    policies_kv = await ensure_policies_bucket(js, config)
    budgets, prices = BudgetSet(), PriceBook(config)
    budgets_kv = await ensure_budgets_bucket(js, config)
    prices_kv = await ensure_prices_bucket(js, config)
    admission = QuotaAdmission(store, policies, config.model_index(),
                               fail_open=cfg.quota_failure == "open", budgets=budgets,
                               prices=prices, spend=config.spend)
    dispatcher = Dispatcher(config, nc, js, admission)
    queue = QueueMode(redis_client, config.nats.subject_prefix)
    if not await preload_scripts(redis_client, [*store.scripts, *queue.scripts]):
        log.warning("could not preload the quota scripts (Redis at %s did not answer); "
                    "each loads on its first use", config.redis.url)

    async def refund(request_id: str) -> None:
        try:
            await store.reconcile(request_id, 0)
        except QuotaUnavailable as exc:
            log.warning("could not refund %s: %s", request_id, exc)

    gate = QueueGate(config, nc, js, queue, dispatcher.dispatch, refund)
    # Tenants' tiers set with `tidegate tenant set --tier` (queue mode's
    # weights); the workers' slots (lower classes wait for spare capacity).
    tenants_kv = await ensure_tenants_bucket(js, config)
    workers_kv = await workers_registry.ensure_bucket(js, config)
    dispatcher.gate = gate
    cancels = await broker.ensure_cancels_bucket(js, config)
    view = ReplicaView(config)
    if view.models and config.routing.affinity == "auto":
        homes, claims = await ensure_routing_buckets(js, config)
        dispatcher.router = Router(config, nc, js, homes, claims, view)
        await nc.subscribe(subjects.load_wildcard, cb=view.on_load_msg)
    log.info("dispatcher pulling from %s", subjects.requests_stream)

    try:
        # Requests are handled as they arrive, up to dispatcher.batch at once.
        requests = Puller(nc, subjects.requests_stream, subjects.dispatcher_consumer,
                          dispatcher.handle_safely, capacity=cfg.batch,
                          expires=cfg.fetch_timeout)
        usage = Puller(nc, subjects.usage_stream, provision.RECONCILERS,
                       Reconciler(store, queue, config).handle, capacity=256,
                       expires=cfg.fetch_timeout)
        async with asyncio.TaskGroup() as tg:
            # Pull only once the stored policies are loaded: a dispatcher
            # that pulled before would admit its first requests unmetered.
            policies_synced = asyncio.Event()
            budgets_synced, prices_synced = asyncio.Event(), asyncio.Event()
            background = [
                tg.create_task(watch_policies(policies_kv, policies,
                                              on_synced=policies_synced.set)),
                tg.create_task(watch_budgets(budgets_kv, budgets,
                                             on_synced=budgets_synced.set)),
                tg.create_task(watch_prices(prices_kv, prices, on_synced=prices_synced.set)),
                tg.create_task(watch_tenants(tenants_kv, gate.tenants)),
                tg.create_task(follow_bucket(workers_kv, gate.workers.on_put,
                                             gate.workers.on_delete)),
                *([tg.create_task(follow_bucket(workers_kv, view.on_put, view.on_delete)),
                   tg.create_task(follow_bucket(
                       dispatcher.router.homes, dispatcher.router.home_cache.on_put,
                       dispatcher.router.home_cache.on_delete))]
                  if dispatcher.router is not None else []),
                await broker.follow_cancels(tg, cancels, dispatcher.on_cancel,
                                            config.nats.request_timeout, "dispatcher"),
            ]
            await wait_synced(policies_synced, config.nats.request_timeout,
                              "dispatcher: quota policies")
            await wait_synced(budgets_synced, config.nats.request_timeout, "dispatcher: budgets")
            await wait_synced(prices_synced, config.nats.request_timeout, "dispatcher: prices")
            pullers = [tg.create_task(requests.run(stop)), tg.create_task(usage.run(stop)),
                       tg.create_task(gate.run(stop)),
                       tg.create_task(batch.Runner(config, nc, js, queue).run(stop))]
            await asyncio.wait(pullers)
            # Let requests being dispatched finish: each is acked only after
            # its job is published.
            in_flight = requests.tasks | usage.tasks
            if in_flight:
                await asyncio.wait(in_flight, timeout=5.0)
            for task in background:
                task.cancel()
            if dispatcher.router is not None:
                await dispatcher.router.close()
    finally:
        await redis_client.aclose()
        await broker.close(nc)
        log.info("dispatcher stopped")
