"""No reservation left behind: a failure at each step between the reserve and
the job's publication refunds the request's money, against a real
redis-server.

The dispatcher (dispatcher/service.py) and the admission policy
(dispatcher/admission.py) run as they do in production, with the real quota
store; only the NATS side is the unit tests' recording fake
(tests/test_dispatcher_unit.py), which is where each failure is injected.
After each failure the budget's counter must be back where it was, unless a
job was published (its worker's usage reconciles it) or the request was left
for redelivery (the next copy reuses the reservation, never charging twice).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from decimal import Decimal
from typing import Any

import nats.errors
import pytest
import redis.asyncio as aioredis

import dispatcher.admission as admission_module
from dispatcher.admission import QuotaAdmission
from dispatcher.quota import BudgetCharge, QuotaResult, QuotaStore, connect
from dispatcher.service import Dispatcher
from tests.servers import ServerHandle
from tests.test_dispatcher_unit import FakeJetStream, FakeMsg, FakeNats, Log, request
from tidegate.config import from_dict
from tidegate.control.budgets import Budget, BudgetSet
from tidegate.control.policies import PolicySet
from tidegate.control.prices import PriceBook

CONFIG = from_dict({"models": [{"name": "m", "simulator": {}, "price_input": 2.0,
                                "price_output": 8.0}]})
NOW = 1_800_000_000.0


class FailingReply(QuotaStore):
    """The script runs (and charges); its reply then cannot be read, as when
    Lua printed a large amount as ``1.00001e+14``."""

    async def reserve(self, request_id: str, scopes: Any, tokens: int,
                      now: float | None = None, budgets: Any = (),
                      money: int = 0) -> QuotaResult:
        await super().reserve(request_id, scopes, tokens, now, budgets, money)
        raise ValueError("invalid literal for int() with base 10: '1.00001e+14'")


class Broken(Exception):
    """A failure that is no broker's or store's: poison for the dispatcher."""


class Failing:
    """A NATS fake that raises ``error`` on its ``at``-th publish (1-based)."""

    def __init__(self, inner: Any, at: int, error: BaseException) -> None:
        self.inner, self.at, self.error, self.calls = inner, at, error, 0

    async def publish(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return await self.inner.publish(*args, **kwargs)


@pytest.fixture
async def client(module_redis_server: ServerHandle) -> AsyncIterator[aioredis.Redis]:
    c = connect(module_redis_server.url, timeout=5.0)
    try:
        yield c
    finally:
        await c.aclose()


def _dispatcher(store: QuotaStore, nc: Any = None, js: Any = None) -> tuple[Dispatcher, Log]:
    budgets = BudgetSet()
    budgets.put(Budget("acme", Decimal("100001"), period="month"))
    policy = QuotaAdmission(store, PolicySet(), CONFIG.model_index(), fail_open=False,
                            budgets=budgets, prices=PriceBook(CONFIG),
                            spend=CONFIG.spend, clock=lambda: NOW)
    log = Log()
    d = Dispatcher(CONFIG, nc or FakeNats(log), js or FakeJetStream(log), policy)
    if nc is not None:
        nc.inner.log = log
    if js is not None:
        js.inner.log = log
    return d, log


async def _spent(client: aioredis.Redis, store: QuotaStore) -> int:
    """Every budget counter of this store's prefix, summed (one budget here)."""
    keys = [k async for k in client.scan_iter(f"{store.key_prefix}b:*:t")]
    return sum(int(v) for v in await client.mget(keys)) if keys else 0


def _store(client: aioredis.Redis, cls: type[QuotaStore] = QuotaStore) -> QuotaStore:
    return cls(client, prefix=f"f{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("step", ["reply", "headers", "alert", "status", "job", "route"])
async def test_a_poison_failure_after_the_reserve_refunds_it(
        client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, step: str) -> None:
    """Each step between the reserve and the job's publication fails with an
    error that is the message's own: the edge gets its 400, the message is
    terminated, and the money is back."""
    store = _store(client, FailingReply if step == "reply" else QuotaStore)
    nc = js = None
    if step == "headers":
        def broken(*_: Any, **__: Any) -> dict[str, str]:
            raise Broken("headers")
        monkeypatch.setattr(admission_module, "rate_limit_headers", broken)
    elif step == "alert":
        def alert(*_: Any) -> None:
            raise Broken("alert")
        monkeypatch.setattr(QuotaAdmission, "_alert", alert)
    elif step == "status":
        nc = Failing(FakeNats(Log()), 1, Broken("status"))
    elif step == "job":
        js = Failing(FakeJetStream(Log()), 1, Broken("job"))
    d, log = _dispatcher(store, nc, js)
    if step == "route":
        class Router:
            def applies(self, model: Any) -> bool:
                return True

            async def route(self, *_: Any) -> Any:
                raise Broken("route")
        d.router = Router()  # type: ignore[assignment]
    assert await _spent(client, store) == 0
    await d.handle_safely(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert "term" in log.names()
    assert "job" not in log.names()
    assert await _spent(client, store) == 0, f"the reservation outlived a failure at {step}"


async def test_a_transient_failure_keeps_the_reservation_for_the_next_copy(
        client: aioredis.Redis) -> None:
    """The job's publish times out: the request is nak'ed, still charged once,
    and its next copy is dispatched without a second charge."""
    store = _store(client)
    js = Failing(FakeJetStream(Log()), 1, nats.errors.TimeoutError())
    d, log = _dispatcher(store, js=js)
    await d.handle_safely(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert log.names()[-1] == "nak"
    charged = await _spent(client, store)
    assert charged > 0
    await d.handle_safely(FakeMsg(log, request().encode(), delivered=2))  # type: ignore[arg-type]
    assert log.names()[-2:] == ["job", "ack"]
    assert await _spent(client, store) == charged, "the second copy was charged again"


@pytest.mark.parametrize("why", ["deadline", "cancelled"])
async def test_a_redelivered_copy_dropped_refunds_what_the_first_reserved(
        client: aioredis.Redis, why: str) -> None:
    """A copy left for redelivery after its reserve, then dropped (its deadline
    passed, or its client cancelled meanwhile), never runs: its money is back."""
    store = _store(client)
    js = Failing(FakeJetStream(Log()), 1, nats.errors.TimeoutError())
    d, log = _dispatcher(store, js=js)
    await d.handle_safely(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert await _spent(client, store) > 0
    again = request(deadline_ms=1) if why == "deadline" else request()
    if why == "cancelled":
        d.on_cancel(again.id, "client")
    await d.handle_safely(FakeMsg(log, again.encode(), delivered=2))  # type: ignore[arg-type]
    assert log.names()[-1] == "ack"
    assert "job" not in log.names()
    assert await _spent(client, store) == 0


async def test_a_failure_after_the_job_is_published_keeps_the_reservation(
        client: aioredis.Redis) -> None:
    """Once the job is out its worker reports the usage that reconciles the
    reservation: a failure after that (here the request's ack) neither
    refunds nor terminates; the request is left for redelivery, deduplicated."""
    store = _store(client)
    d, log = _dispatcher(store)
    msg = FakeMsg(log, request().encode())

    async def ack() -> None:
        raise Broken("ack")
    msg.ack = ack  # type: ignore[method-assign]
    await d.handle_safely(msg)  # type: ignore[arg-type]
    assert "job" in log.names()
    assert "term" not in log.names()
    charged = await _spent(client, store)
    assert charged > 0
    await store.reconcile("r1", 0, actual_money=charged - 1)  # the worker's usage
    assert await _spent(client, store) == charged - 1


async def test_the_counter_read_here_is_the_one_the_store_charges(
        client: aioredis.Redis) -> None:
    """Guards the tests above: a zero they read means nothing if they read
    another key than the store charges."""
    store = _store(client)
    result = await store.reserve("x", [], 0, now=NOW, budgets=[BudgetCharge("b", 10**18, "p")],
                                 money=10**17 + 1)
    assert result.admitted
    assert await _spent(client, store) == 10**17 + 1
