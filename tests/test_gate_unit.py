"""dispatcher/gate.py's decisions with fakes: the shared queue (QueueMode's
``enqueue``/``positions``), the NATS client and the held JetStream messages.

What the edge is told (Status QUEUED with a position, REJECTED 503 with
``queue_full``/``queue_timeout``), whether the request is dispatched, acked
or refunded: the same paths test_queue_mode.py drives on real servers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace
from typing import Any

import msgpack

from dispatcher.gate import QueueGate
from dispatcher.queueing import ModeState
from dispatcher.quota import QuotaUnavailable
from tests.poll import eventually
from tidegate import config as tgconfig
from tidegate.wire.protocol import Admission, Api, Request, Status, decode_session

CONFIG = tgconfig.from_dict({"models": [{"name": "m", "simulator": {},
                                         "queue": {"ttft_p99": 0.5, "ttl": 7.0}}]})
MODEL = CONFIG.models[0]
QUEUEING = ModeState(queueing=True, limit=2)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def names(self) -> list[str]:
        return [n for n, _ in self.events]

    def statuses(self) -> list[Status]:
        return [e for n, e in self.events if n == "status"]


class FakeNats:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec

    async def publish(self, subject: str, payload: bytes) -> None:
        self.rec.events.append(("status", decode_session(payload)))


class FakeMsg:
    def __init__(self, rec: Recorder, request_id: str) -> None:
        self.rec, self.request_id = rec, request_id

    async def ack(self) -> None:
        self.rec.events.append(("ack", self.request_id))

    async def in_progress(self) -> None:
        self.rec.events.append(("in_progress", self.request_id))


class FakeQueue:
    def __init__(self, state: str = "queued", position: int = 3,
                 positions: list[int] | None = None, down: bool = False) -> None:
        self.state, self.position, self.down = state, position, down
        self.answer_positions = positions or []
        self.enqueued: list[tuple[str, str, str]] = []
        self.costs: list[tuple[float, float | None]] = []  # each enqueue's cost and ttl

    async def enqueue(self, model: str, request_id: str, tenant: str, klass: str,
                      owner: str, now: float, cfg: Any, cost: float = 1.0,
                      ttl: float | None = None) -> tuple[str, int]:
        if self.down:
            raise QuotaUnavailable("redis down")
        self.enqueued.append((request_id, tenant, klass))
        self.costs.append((cost, ttl))
        return self.state, self.position

    async def positions(self, model: str, request_ids: list[str]) -> list[int]:
        return self.answer_positions


def make(queue: FakeQueue, mode: ModeState | None = QUEUEING,
         backlog: int = 0) -> tuple[QueueGate, Recorder]:
    rec = Recorder()

    async def dispatch(request: Request, msg: Any, headers: dict[str, str],
                       reserved: bool) -> None:
        rec.events.append(("dispatch", (request.id, reserved)))

    async def refund(request_id: str) -> None:
        rec.events.append(("refund", request_id))

    gate = QueueGate(CONFIG, FakeNats(rec), SimpleNamespace(), queue,  # type: ignore[arg-type]
                     dispatch, refund)
    if mode is not None:
        gate.modes["m"] = mode
    gate.backlog["m"] = backlog
    return gate, rec


def request(request_id: str = "r1", klass: str = "interactive") -> Request:
    now_ms = int(time.time() * 1000)
    return Request(id=request_id, reply=CONFIG.nats.subjects.out("e", request_id), model="m",
                   api=Api.CHAT, stream=True, body={}, created_ms=now_ms,
                   deadline_ms=now_ms + 60_000, window_bytes=1 << 16, window_msgs=64,
                   tenant="acme", klass=klass)


async def admit(gate: QueueGate, rec: Recorder, request_id: str = "r1",
                klass: str = "interactive") -> bool:
    return await gate.admit(request(request_id, klass), FakeMsg(rec, request_id),  # type: ignore[arg-type]
                            {"x-ratelimit-limit-tokens": "9"}, MODEL, True)


async def test_normal_mode_without_backlog_dispatches_at_once() -> None:
    queue = FakeQueue()
    gate, rec = make(queue, mode=ModeState(queueing=False))
    assert await admit(gate, rec)
    assert queue.enqueued == []
    assert rec.events == []


async def test_a_backlog_queues_even_after_queue_mode_ends() -> None:
    """Leaving queue mode with requests still queued: new ones queue behind
    them (fairness), they do not overtake."""
    queue = FakeQueue(position=4)
    gate, rec = make(queue, mode=ModeState(queueing=False), backlog=3)
    assert not await admit(gate, rec)
    assert [s.position for s in rec.statuses()] == [4]


async def test_queued_is_held_unacked_and_told_its_position() -> None:
    queue = FakeQueue(position=3)
    gate, rec = make(queue)
    assert not await admit(gate, rec, klass="batch")
    assert queue.enqueued == [("r1", "acme", "batch")]
    # a batch line waits up to batch_ttl (240 s), but never past its deadline (60 s away)
    [(cost, ttl)] = queue.costs
    assert cost >= 1
    assert ttl is not None
    assert 0 < ttl <= 60
    [status] = rec.statuses()
    assert (status.admission, status.position) == (Admission.QUEUED, 3)
    assert status.headers == {"x-ratelimit-limit-tokens": "9"}
    assert "ack" not in rec.names(), "held: acked only once dispatched or rejected"
    assert "r1" in gate.held


async def test_full_queue_and_expired_are_503_acked_and_refunded() -> None:
    for state, code in (("full", "queue_full"), ("expired", "queue_timeout")):
        gate, rec = make(FakeQueue(state=state))
        assert not await admit(gate, rec)
        [status] = rec.statuses()
        assert status.admission is Admission.REJECTED
        assert status.error is not None
        assert (status.error.status, status.error.code, status.error.retryable) == (
            503, code, True)
        assert rec.names() == ["status", "ack", "refund"]
        assert gate.held == {}


async def test_granted_at_enqueue_dispatches_now() -> None:
    gate, rec = make(FakeQueue(state="granted"))
    assert await admit(gate, rec)
    assert gate.held == {}


async def test_queue_store_down_admits_rather_than_loses() -> None:
    gate, rec = make(FakeQueue(down=True))
    assert await admit(gate, rec)
    assert rec.events == []


async def test_grants_dispatch_or_expire_what_this_dispatcher_holds() -> None:
    gate, rec = make(FakeQueue())
    await admit(gate, rec, "r1")
    await admit(gate, rec, "r2")
    rec.events.clear()
    grant = SimpleNamespace(data=msgpack.packb([("r1", True), ("r2", False),
                                                ("elsewhere", True)]))
    await gate.on_grant(grant)  # type: ignore[arg-type]
    assert rec.events[0] == ("dispatch", ("r1", True))
    assert rec.names()[1:] == ["status", "ack", "refund"]
    assert rec.statuses()[0].error.code == "queue_timeout"  # type: ignore[union-attr]
    assert gate.held == {}


async def test_positions_update_and_a_lost_grant_is_recovered_from_redis() -> None:
    queue = FakeQueue(position=5)
    gate, rec = make(queue)
    for rid in ("same", "moved", "granted", "expired", "displaced"):
        await admit(gate, rec, rid)
    rec.events.clear()
    # Redis says: same place, moved up to 2, granted (-1), expired (-2),
    # displaced by a better class (-3).
    queue.answer_positions = [5, 2, -1, -2, -3]
    await gate._send_positions([MODEL])
    assert ("dispatch", ("granted", True)) in rec.events
    queued = [s for s in rec.statuses() if s.admission is Admission.QUEUED]
    assert [s.position for s in queued] == [2], "only a changed position is sent"
    rejected = [s for s in rec.statuses() if s.admission is Admission.REJECTED]
    assert [s.error.code for s in rejected] == [  # type: ignore[union-attr]
        "queue_timeout", "queue_full"]
    assert all(s.error.retryable for s in rejected)  # type: ignore[union-attr]
    assert ("ack", "expired") in rec.events
    assert ("ack", "displaced") in rec.events
    assert set(gate.held) == {"same", "moved"}


async def test_lower_classes_wait_for_spare_capacity_on_a_model_without_queue_mode() -> None:
    """No queue mode (the default): interactive requests always go; a
    background response or batch line goes only while the model has a free
    slot and nothing of its class waits, else it is queued for a grant."""
    plain = dataclasses.replace(MODEL, queue=tgconfig.QueueModeConfig())
    queue = FakeQueue(position=1)
    gate, rec = make(queue, mode=None)
    jobs = SimpleNamespace(running=1)  # the model's one slot is taken

    async def consumer_info(stream: str, consumer: str) -> Any:
        return SimpleNamespace(num_pending=0, num_ack_pending=jobs.running)

    gate.js = SimpleNamespace(consumer_info=consumer_info)  # type: ignore[assignment]
    gate.workers.of = lambda model, now: 1  # type: ignore[method-assign]

    async def goes(rid: str, klass: str = "interactive") -> bool:
        return await gate.admit(request(rid, klass), FakeMsg(rec, rid),  # type: ignore[arg-type]
                                {}, plain, True)

    gate.spare["m"] = 0  # the last tick found the workers' slots all taken
    assert await goes("chat")
    assert not await goes("bg", "background")
    assert not await goes("line", "batch")
    assert [rid for rid, _, _ in queue.enqueued] == ["bg", "line"]
    assert set(gate.held) == {"bg", "line"}
    assert [s.admission for s in rec.statuses()] == [Admission.QUEUED] * 2
    # A slot freed since that tick: read again, a lower class goes at once
    # (a batch runner releases a line the moment one frees).
    jobs.running = 0
    assert await goes("bg2", "background")
    assert gate.spare["m"] > 0
    gate.backlog["m"] = 2
    assert not await goes("bg3", "background")
    assert await goes("chat2")  # a backlog holds interactive requests only in queue mode


def test_a_models_slots_are_its_live_workers_not_draining_ones() -> None:
    from dispatcher.gate import WorkerSlots
    from tidegate.control.workers_registry import SlotInfo, WorkerInfo

    now = time.time()
    slots = WorkerSlots()
    slots.on_put("w1", WorkerInfo("w1", updated=now, models={"m": SlotInfo(4, 4)}).encode())
    slots.on_put("w2", WorkerInfo("w2", updated=now, models={"m": SlotInfo(3, 0)}).encode())
    slots.on_put("w3", WorkerInfo("w3", updated=now, draining=True,
                                  models={"m": SlotInfo(8, 0)}).encode())
    slots.on_put("w4", WorkerInfo("w4", updated=now - 60, models={"m": SlotInfo(8, 0)}).encode())
    slots.on_put("w5", b"not json")
    assert slots.of("m", now) == 7
    slots.on_delete("w2")
    assert slots.of("m", now) == 4
    assert slots.of("other", now) == 0


async def test_a_preempt_ask_carries_the_requests_tier_weight() -> None:
    """Workers give a stream's slot only to a heavier tier: the ask says how
    heavy the request that waits is (workers.preemption). An interactive
    request asks when it found no free slot, counted from the last tick less
    the dispatches since (a burst within one tick), and the model is still
    full once the budget ran out."""
    config = tgconfig.from_dict({
        "models": [{"name": "m", "simulator": {}, "queue": {"preempt_after": 0.01}}],
        "tiers": [{"name": "gold", "weight": 4, "tenants": ["acme"]}]})
    asks: list[tuple[str, bytes]] = []

    class Nats:
        async def publish(self, subject: str, payload: bytes) -> None:
            asks.append((subject, payload))

    async def nothing(*_: Any) -> None:
        return None

    gate = QueueGate(config, Nats(), SimpleNamespace(), FakeQueue(),  # type: ignore[arg-type]
                     nothing, nothing)
    running = SimpleNamespace(jobs=0, reads=0)

    async def consumer_info(stream: str, consumer: str) -> Any:
        running.reads += 1
        return SimpleNamespace(num_pending=0, num_ack_pending=running.jobs)

    gate.js = SimpleNamespace(consumer_info=consumer_info)  # type: ignore[assignment]
    gate.workers.of = lambda model, now: 2  # type: ignore[method-assign]
    model = config.models[0]
    gate.preempt_for(request(), model)  # no worker known yet: no ask
    await gate._full_now(model)  # a tick: 2 slots, none taken
    gate.preempt_for(request(), model)  # a slot was free: no ask
    gate.preempt_for(request(klass="background"), model)  # took the last; only interactive ask
    running.jobs = 2
    gate.preempt_for(request(), model)  # none free since the tick, but full: no ask yet
    assert gate.spare["m"] == -1
    await eventually(lambda: asks, 5.0, "the ask")
    await asyncio.sleep(0.05)
    assert asks == [(config.nats.subjects.preempt("m"), b"4.0")]
    running.jobs = 1  # a slot freed before the budget ran out: no ask
    gate.preempt_for(request(), model)
    await asyncio.sleep(0.1)
    assert len(asks) == 1
    # A burst's budgets run out together: one read of the jobs for them all.
    # (Its first request takes the slot the last read found free.)
    running.jobs, running.reads = 2, 0
    for _ in range(5):
        gate.preempt_for(request(), model)
    await eventually(lambda: len(asks) == 5, 5.0, "the burst's asks")
    assert running.reads == 1
    assert (gate.weight("acme"), gate.weight("other")) == (4.0, 1.0)
