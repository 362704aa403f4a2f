"""The dispatcher's side of queue mode: hold queued requests, release on grant.
Per dispatcher process, for every model with ``queue.ttft_p99`` set:

* a controller tick (every ``_TICK`` s): one dispatcher at a time (a Redis
  lease) folds finished windows into the model's mode, reads how many jobs are
  in flight from JetStream (``num_pending + num_ack_pending`` of the model's
  worker consumer), grants queued requests up to the limit, and expires the
  overdue; every dispatcher refreshes its cached mode;
* the requests it queued stay unacked JetStream messages it holds (in-progress
  acks keep them from redelivery); a grant on ``<p>.grant.<dispatcher>``
  dispatches them, an expiry rejects them with 503 ``queue_timeout``;
* queued clients get their position (a Status QUEUED) whenever it changes;
* a request costs its reserved tokens over its tier's weight and waits its
  class's TTL, never past its deadline.
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
from tidegate.control.tenants import TenantTable
from tidegate.telemetry import telemetry as tm
from tidegate.wire.protocol import Admission, ErrorInfo, Request, Status

log = logging.getLogger("tidegate.dispatcher")

_TICK = 0.25  # controller period, seconds
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

    @property
    def grant_subject(self) -> str:
        return f"{self.config.nats.subject_prefix}.grant.{self.owner}"

    def models(self) -> list[ModelConfig]:
        return [m for m in self.config.models if m.queue.ttft_p99 > 0]

    # -- admission ---------------------------------------------------------------

    async def admit(self, request: Request, msg: Msg, headers: dict[str, str],
                    model: ModelConfig, reserved: bool) -> bool:
        """True: dispatch now. False: the gate took the request (queued or
        answered it)."""
        mode = self.modes.get(model.name, ModeState())
        if not mode.queueing and not self.backlog.get(model.name):
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
        tier = self.tier(request.tenant)
        try:
            tokens = reservation(request.api, request.body, model.reserve_max_tokens)
        except Exception:  # a body a dialect cannot size: one turn, never a lost request
            tokens = 1
        return max(1, tokens) / (tier.weight if tier is not None else 1.0)

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
        while not stop.is_set():
            now = time.monotonic()
            for model in models:
                try:
                    await self._control(model)
                except QuotaUnavailable as exc:
                    log.warning("queue mode for %s paused: %s", model.name, exc)
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
        if await self.queue.lead(model.name, self.owner, hold=_TICK * 4):
            running = await self._running(model)
            state = await self.queue.evaluate(model.name, running, now, model.queue)
            capacity = state.limit - running if state.queueing else 1 << 30
            grants = await self.queue.grant(model.name, capacity, now)
            if grants:
                by_owner: dict[str, list[tuple[str, bool]]] = {}
                for g in grants:
                    by_owner.setdefault(g.owner, []).append((g.request_id, g.granted))
                for owner, items in by_owner.items():
                    subject = f"{self.config.nats.subject_prefix}.grant.{owner}"
                    await self.nc.publish(subject, msgpack.packb(items))
        else:
            state = await self.queue.state(model.name)
        previous = self.modes.get(model.name)
        if previous is not None and previous.queueing != state.queueing:
            log.warning("model %s %s queue mode (p99 TTFT %.0f ms, limit %d)", model.name,
                        "entered" if state.queueing else "left", state.p99_ms, state.limit)
        self.modes[model.name] = state
        self.backlog[model.name] = await self.queue.queued(model.name)
        metrics, attrs = tm.get().metrics, {tm.MODEL: model.name}
        metrics.queue_mode.set(1 if state.queueing else 0, attrs)
        metrics.queue_mode_limit.set(state.limit if state.queueing else 0, attrs)
        for klass, n in (await self.queue.queued_by_class(model.name)).items():
            metrics.queue_mode_queued.set(n, {**attrs, tm.REQUEST_CLASS: klass})

    async def _running(self, model: ModelConfig) -> int:
        """Jobs admitted and not finished: waiting in the jobs stream or running."""
        subjects = self.config.nats.subjects
        try:
            info = await self.js.consumer_info(subjects.jobs_stream,
                                               subjects.worker_consumer(model.name))
        except Exception:
            return 0  # no worker has created its consumer yet: nothing runs
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

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
