"""Prices, costs and budgets: the pure parts, then budgets in the quota store
against a real redis-server (fake clock through ``now=`` / ``clock=``)."""

from __future__ import annotations

import asyncio
import uuid
import zoneinfo
from collections.abc import AsyncIterator
from datetime import datetime
from decimal import Decimal
from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher.admission import QuotaAdmission
from dispatcher.quota import BudgetCharge, Limits, QuotaStore, Scope, connect
from tests.servers import ServerHandle
from tidegate.apis import estimate_prompt_tokens, reservation
from tidegate.config import SpendConfig, from_dict
from tidegate.control.budgets import MAX_AMOUNT, Budget, BudgetSet, period_window
from tidegate.control.policies import PolicySet
from tidegate.control.prices import (
    MAX_PRICE,
    NANO,
    Price,
    PriceBook,
    cost_member,
    format_money,
    price_spec,
    to_nanos,
)
from tidegate.errors import ConfigError, ProtocolError
from tidegate.wire.protocol import Admission, Api, Request, UsageRecord

NY = zoneinfo.ZoneInfo("America/New_York")


def ts(text: str, tz: zoneinfo.ZoneInfo = NY) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=tz).timestamp()


# -- prices ------------------------------------------------------------------


def test_cost_is_exact_with_cached_tokens_at_their_price() -> None:
    price = Price("m", input=Decimal("3"), cached_input=Decimal("0.3"), output=Decimal("15"),
                  request=Decimal("0.0001"))
    # 1000 prompt tokens, 800 of them cached; 200 output tokens:
    # 200 x 3 + 800 x 0.3 + 200 x 15 = 600 + 240 + 3000 = 3840 per million
    # = 0.00384, + 0.0001 per request = 0.00394
    assert format_money(price.cost(1000, 200, cached_tokens=800)) == "0.00394"
    # billed at the full price, the cached tokens would cost 0.002160 more
    assert price.cost(1000, 200) - price.cost(1000, 200, 800) == 2_160_000
    # cached tokens can never exceed the prompt, nor go negative
    assert price.cost(10, 0, cached_tokens=99) == price.cost(10, 0, cached_tokens=10)
    assert price.cost(10, 0, cached_tokens=-5) == price.cost(10, 0)


def test_cost_rounds_half_up_to_the_nano_unit() -> None:
    price = Price("m", input=Decimal("0.0015"))  # 1.5e-9 per token
    assert price.cost(1, 0) == 2
    assert price.cost(3, 0) == 5  # 4.5 -> 5
    assert Price("m", cached_input=None, input=Decimal("2")).cached == Decimal("2")


def test_format_money() -> None:
    assert format_money(0) == "0"
    assert format_money(1) == "0.000000001"
    assert format_money(1_500_000_000) == "1.5"
    assert format_money(12 * 10**9) == "12"


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "1e400000", "abc", True, None, [],
                                 "10000000"])
def test_hostile_prices_are_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="input"):
        Price("m", input=bad)


@pytest.mark.parametrize("data", [b"[]", b"{", b'{"model":"m","input":"-1"}',
                                  b'{"model":"m","evil":1}', b'{"input":"1"}',
                                  b'{"model":"","input":"1"}'])
def test_malformed_stored_prices_are_protocol_errors(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Price.decode(data)


def test_price_book_kv_overrides_config_and_ignores_garbage() -> None:
    config = from_dict({"models": [{"name": "a", "price_input": 1.0, "price_output": 2.0},
                                   {"name": "b"}]})
    book = PriceBook(config)
    assert book.get("a") == Price("a", input=Decimal("1.0"), output=Decimal("2.0"))
    assert book.get("b") is None
    stored = Price("a", input=Decimal("5"))
    book.apply("a", stored.encode())
    assert book.get("a") == stored
    book.apply("a", b"garbage")  # ignored: what was in force stays
    book.apply("b", stored.encode())  # stored under another model's key: ignored
    assert book.get("a") == stored
    assert book.get("b") is None
    book.remove("a")
    assert book.get("a") == Price("a", input=Decimal("1.0"), output=Decimal("2.0"))


def test_config_refuses_bad_spend_settings() -> None:
    with pytest.raises(ConfigError, match=r"spend\.timezone"):
        from_dict({"spend": {"timezone": "Mars/Olympus"}})
    with pytest.raises(ConfigError, match="price_input"):
        from_dict({"models": [{"name": "a", "price_input": -1.0}]})
    with pytest.raises(ConfigError, match="alert_at"):
        from_dict({"spend": {"alert_at": [0.0]}})


def test_cost_member_is_an_extension_openai_clients_ignore() -> None:
    spec = price_spec(Price("m", input=Decimal("1"), output=Decimal("2")), "EUR")
    assert cost_member(spec, 1000, 1000, 0) == b',"x_tidegate":{"cost":"0.003","currency":"EUR"}'
    assert cost_member(None, 1, 1, 0) == b""
    assert cost_member({"currency": "EUR", "input": "-3", "model": "m"}, 1, 1, 0) == b""


def test_usage_record_carries_cost_and_refuses_bad_amounts() -> None:
    record = UsageRecord(id="r", model="m", outcome="done", cached_tokens=3,
                         cost_nanos=12345, currency="USD")
    assert UsageRecord.decode(record.encode()) == record
    for bad in (UsageRecord(id="r", model="m", outcome="done", cost_nanos=-1),
                UsageRecord(id="r", model="m", outcome="done",
                            cost_nanos="1" )):  # type: ignore[arg-type]
        with pytest.raises(ProtocolError):
            UsageRecord.decode(bad.encode())


# -- budgets and periods -------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"tenant": "", "amount": "1"},
    {"tenant": "t", "amount": "-1"},
    {"tenant": "t", "amount": "nan"},
    {"tenant": "t", "amount": "1e12"},
    {"tenant": "t", "amount": "1", "period": "year"},
    {"tenant": "t", "amount": "1", "period": "rolling", "window": 1.0},
    {"tenant": "t", "amount": "1", "period": "day", "window": 3600.0},
    {"tenant": "t", "amount": "1", "model": "m", "user": "u"},
    {"tenant": "t", "amount": "1", "soft": "yes"},
])
def test_hostile_budgets_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=r"budget|amount|period|window|soft"):
        Budget(**kwargs)


def test_budget_set_finds_the_scopes_a_request_falls_in() -> None:
    budgets = BudgetSet()
    tenant = Budget("acme", Decimal("10"))
    daily = Budget("acme", Decimal("1"), period="day")
    model = Budget("acme", Decimal("5"), model="gpt")
    key = Budget("acme", Decimal("2"), key="abcdef012345")
    other = Budget("umbrella", Decimal("2"))
    for b in (tenant, daily, model, key, other):
        budgets.apply(b.budget_id, b.encode())
    assert set(budgets.applicable("acme", "gpt", "", "abcdef012345")) == {
        tenant, daily, model, key}
    assert set(budgets.applicable("acme", "llama")) == {tenant, daily}
    budgets.remove(daily.budget_id)
    assert set(budgets.applicable("acme", "llama")) == {tenant}
    budgets.apply(tenant.budget_id, b"not json")  # ignored
    assert len(budgets) == 4


def test_calendar_periods_in_the_configured_time_zone() -> None:
    month = Budget("t", Decimal(1), period="month")
    week = Budget("t", Decimal(1), period="week")
    day = Budget("t", Decimal(1), period="day")
    now = ts("2026-03-31T23:59:59")
    assert period_window(month, now, NY).label == "m2026-03"
    assert period_window(month, now, NY).reset_in == pytest.approx(1.0)
    assert period_window(month, now + 1, NY).label == "m2026-04"
    # In UTC the same instant is already April.
    assert period_window(month, now, zoneinfo.ZoneInfo("UTC")).label == "m2026-04"
    # A week starts on Monday (2026-03-30 is one).
    assert period_window(week, now, NY).label == "w2026-03-30"
    # The day DST starts in New York has 23 hours.
    dst = ts("2026-03-08T00:00:00")
    assert period_window(day, dst, NY).reset_in == pytest.approx(23 * 3600)


# -- budgets in Redis -----------------------------------------------------------


@pytest.fixture
async def client(module_redis_server: ServerHandle) -> AsyncIterator[aioredis.Redis]:
    c = connect(module_redis_server.url, timeout=2.0)
    try:
        yield c
    finally:
        await c.aclose()


@pytest.fixture
def store(client: aioredis.Redis) -> QuotaStore:
    return QuotaStore(client, prefix=f"s{uuid.uuid4().hex[:8]}", window=60.0, lease=1800.0)


def charge(limit: int, period: str = "p1", window: float = 0.0, reset_in: float = 100.0,
           soft: bool = False, bid: str = "b") -> BudgetCharge:
    return BudgetCharge(bid, limit, period, window, reset_in, 1000.0, soft)


async def test_budget_reserve_then_reconcile(store: QuotaStore) -> None:
    budget = charge(1000)
    first = await store.reserve("r1", [], 0, now=0.0, budgets=[budget], money=600)
    assert first.admitted
    assert first.remaining_budget == 400
    refused = await store.reserve("r2", [], 0, now=1.0, budgets=[budget], money=600)
    assert not refused.admitted
    assert refused.limit == "budget"
    assert refused.scope == "b"
    assert refused.retry_after == pytest.approx(100.0)  # the period's end
    # r1 cost less than reserved: the difference is free again.
    await store.reconcile("r1", 0, actual_money=150)
    await store.reconcile("r1", 0, actual_money=999)  # idempotent
    again = await store.reserve("r2", [], 0, now=2.0, budgets=[budget], money=600)
    assert again.admitted
    assert again.budget_spent == (750,)
    too_large = await store.reserve("r3", [], 0, now=3.0, budgets=[budget], money=1001)
    assert too_large.too_large


async def test_budget_and_tokens_are_charged_together_or_not_at_all(
        store: QuotaStore) -> None:
    scope = Scope("s", Limits(tpm=100))
    budget = charge(1000)
    refused = await store.reserve("r1", [scope], 50, now=0.0, budgets=[budget], money=2000)
    assert not refused.admitted
    # neither the tokens nor the money were charged
    ok = await store.reserve("r2", [scope], 100, now=0.0, budgets=[budget], money=1000)
    assert ok.admitted
    assert ok.remaining_tokens == 0
    assert ok.remaining_budget == 0
    # the token limit refuses a request the budget had room for: no money charged
    await store.reconcile("r2", 100, actual_money=0)
    refused = await store.reserve("r3", [scope], 10, now=1.0, budgets=[budget], money=10)
    assert not refused.admitted
    assert refused.limit == "tokens"
    assert refused.budget_spent == (0,)


async def test_soft_budget_never_refuses(store: QuotaStore) -> None:
    soft = charge(100, soft=True)
    for i in range(3):
        result = await store.reserve(f"r{i}", [], 0, now=float(i), budgets=[soft], money=80)
        assert result.admitted
    assert result.budget_spent == (240,)
    assert result.remaining_budget == -1  # soft budgets give no header


async def test_rolling_budget_frees_as_the_oldest_spend_leaves(store: QuotaStore) -> None:
    rolling = charge(1000, period="", window=3600.0)
    assert (await store.reserve("a", [], 0, now=0.0, budgets=[rolling], money=700)).admitted
    assert (await store.reserve("b", [], 0, now=600.0, budgets=[rolling], money=300)).admitted
    refused = await store.reserve("c", [], 0, now=1200.0, budgets=[rolling], money=500)
    assert not refused.admitted
    assert refused.retry_after == pytest.approx(2400.0)  # "a" leaves at 3600
    # reconciled down, "b" leaves room at once
    await store.reconcile("b", 0, actual_money=0)
    assert (await store.reserve("c", [], 0, now=1201.0, budgets=[rolling],
                                money=300)).admitted
    assert (await store.reserve("d", [], 0, now=3600.5, budgets=[rolling],
                                money=700)).admitted


async def test_budget_resets_at_the_period_boundary_with_a_fake_clock(
        store: QuotaStore) -> None:
    """Through the admission policy: a monthly budget in New York time, the
    clock set to the last second of March there, then to April."""
    now = [ts("2026-03-31T23:59:58")]
    budgets = BudgetSet()
    budget = Budget("acme", Decimal("0.05"), period="month")
    budgets.put(budget)
    config = from_dict({"models": [{"name": "m", "price_input": 1000.0,
                                    "price_output": 1000.0}],
                        "spend": {"timezone": "America/New_York"}})
    admission = QuotaAdmission(store, PolicySet(), config.model_index(), fail_open=False,
                               budgets=budgets, prices=PriceBook(config),
                               spend=config.spend, clock=lambda: now[0])
    body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    per_request = Price("m", input=Decimal(1000), output=Decimal(1000)).cost(
        estimate_prompt_tokens(Api.CHAT, body), 2)
    fits = budget.nanos // per_request
    assert fits >= 2

    def request(i: int) -> Request:
        return Request(id=f"r{i}", reply="x", model="m", api=Api.CHAT, stream=False,
                       body=body, created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1,
                       tenant="acme")

    for i in range(fits):
        assert (await admission.admit(request(i))).admission is Admission.ADMITTED
    refused = await admission.admit(request(fits))
    assert refused.admission is Admission.REJECTED
    assert refused.error is not None
    assert refused.error.code == "budget_exceeded"
    assert refused.error.retry_after == pytest.approx(2.0)  # April starts in 2 s, NY time
    assert "x-ratelimit-remaining-budget" in refused.headers
    now[0] = ts("2026-03-31T23:59:59.999")
    assert (await admission.admit(request(fits + 1))).admission is Admission.REJECTED
    now[0] = ts("2026-04-01T00:00:00")  # the boundary: a new period, from zero
    admitted = await admission.admit(request(fits + 2))
    assert admitted.admission is Admission.ADMITTED
    assert admitted.headers["x-ratelimit-remaining-budget"] == format_money(
        budget.nanos - per_request)


async def test_alerts_at_80_and_100_percent(store: QuotaStore,
                                            caplog: pytest.LogCaptureFixture) -> None:
    budgets = BudgetSet()
    soft = Budget("acme", Decimal("0.001"), period="day", soft=True)
    budgets.put(soft)
    config = from_dict({"models": [{"name": "m", "price_request": 0.0002}]})
    admission = QuotaAdmission(store, PolicySet(), config.model_index(), fail_open=False,
                               budgets=budgets, prices=PriceBook(config),
                               spend=SpendConfig(), clock=lambda: 1_800_000_000.0)
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    caplog.set_level("WARNING", logger="tidegate.dispatcher")
    for i in range(6):  # 0.0002 each: 80 % after the 4th, 100 % after the 5th
        decision = await admission.admit(Request(
            id=f"a{i}", reply="x", model="m", api=Api.CHAT, stream=False, body=body,
            created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1, tenant="acme"))
        assert decision.admission is Admission.ADMITTED  # soft: never refused
    alerts = [r.getMessage() for r in caplog.records if "budget alert" in r.getMessage()]
    assert len(alerts) == 2, alerts
    assert "reached 80%" in alerts[0]
    assert "reached 100%" in alerts[1]


def _burst(url: str, prefix: str, worker: int, money: list[int], out: Any) -> None:
    async def main() -> None:
        client = connect(url, timeout=5.0)
        store = QuotaStore(client, prefix=prefix)
        admitted = -1
        try:
            results = []
            for start in range(0, len(money), 10):  # 10 in flight per process
                results += await asyncio.gather(*(
                    store.reserve(f"w{worker}-{i}", [], 0, budgets=[charge(1_000_000)],
                                  money=money[i])
                    for i in range(start, min(start + 10, len(money)))))
            admitted = sum(amount for amount, r in zip(money, results, strict=True)
                           if r.admitted)
        finally:
            await client.aclose()
            out.put(admitted)

    asyncio.run(main())


def test_three_processes_never_overspend_a_budget(module_redis_server: ServerHandle) -> None:
    """Three processes (as three dispatchers) race 3 x 200 reservations of
    1,000 to 9,000 nano-units at a budget of 1,000,000: what they admit
    together never passes it."""
    import multiprocessing
    import random

    rng = random.Random(7)
    prefix = f"s{uuid.uuid4().hex[:8]}"
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_burst, args=(module_redis_server.url, prefix, w,
                                              [rng.randint(1, 9) * 1000 for _ in range(200)],
                                              out)) for w in range(3)]
    for p in procs:
        p.start()
    admitted = sum(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert 990_000 <= admitted <= 1_000_000


def test_reservation_reserves_the_completion_cap_at_the_output_price() -> None:
    body = {"model": "m", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}]}
    tokens = reservation(Api.CHAT, body, 1024)
    prompt = estimate_prompt_tokens(Api.CHAT, body)
    assert tokens - prompt == 100


# -- money exact at every magnitude ----------------------------------------------
# Lua's numbers are doubles: exact to 2^53 nano-units (about 9 million currency
# units). A budget of 100,001 units (1.00001e14 nano-units) once came back from
# the reserve script as "1.00001e+14", which int() refused: every request of the
# scope failed after its reservation was charged.

MAX_NANOS = to_nanos(MAX_AMOUNT)  # the largest budget the CLI accepts
# The most one request can cost: every price at its maximum, 2^18 prompt and
# 2^18 output tokens, and the per-request price.
MAX_COST = Price("m", input=MAX_PRICE, output=MAX_PRICE, request=MAX_PRICE).cost(
    2**18, 2**18)
_money = st.one_of(st.integers(1, MAX_NANOS), st.sampled_from(
    [1, 2**53 - 1, 2**53, 2**53 + 1, 100_001 * NANO, 10**14 + 1, 10**17 + 3, MAX_NANOS]))


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(limit=_money, money=_money, actual=st.integers(0, MAX_COST), rolling=st.booleans())
def test_money_is_exact_at_every_magnitude(module_redis_server: ServerHandle, limit: int,
                                           money: int, actual: int, rolling: bool) -> None:
    """A reservation of any amount up to the largest budget, against any
    budget up to it, calendar or rolling: admitted exactly when it fits, the
    spend and what is left to the nano-unit, and reconciliation to any cost a
    request can reach leaves the counter at exactly that cost."""
    async def main() -> None:
        client = connect(module_redis_server.url, timeout=5.0)
        store = QuotaStore(client, prefix=f"x{uuid.uuid4().hex[:8]}")
        budget = charge(limit, period="" if rolling else "p",
                        window=3600.0 if rolling else 0.0)
        try:
            first = await store.reserve("r1", [], 0, now=0.0, budgets=[budget], money=money)
            assert first.admitted is (money <= limit)
            if not first.admitted:
                assert first.too_large
                assert first.budget_spent == (0,)
                return
            assert first.budget_spent == (money,)
            assert first.remaining_budget == limit - money
            await store.reconcile("r1", 0, actual_money=actual)
            _, _, t = (f"{store.budget_base(budget)}:{k}" for k in "wat")
            assert int(await client.get(t)) == actual
            # the next reservation sees exactly what is left
            room = limit - actual
            second = await store.reserve("r2", [], 0, now=1.0, budgets=[budget],
                                         money=money)
            assert second.admitted is (money <= room)
            assert second.remaining_budget == max(room - money if second.admitted
                                                  else room, 0)
            assert second.budget_spent == ((actual + money,) if second.admitted
                                           else (actual,))
        finally:
            await client.aclose()

    asyncio.run(main())


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(amounts=st.lists(_money, min_size=1, max_size=6))
def test_a_soft_budget_sums_spend_exactly(module_redis_server: ServerHandle,
                                          amounts: list[int]) -> None:
    """A soft budget never refuses, so its spend grows past any limit: the sum
    of every reservation, exact, and each one reconciled away to the nano-unit."""
    async def main() -> None:
        client = connect(module_redis_server.url, timeout=5.0)
        store = QuotaStore(client, prefix=f"x{uuid.uuid4().hex[:8]}")
        soft = charge(1, soft=True)
        try:
            for i, amount in enumerate(amounts):
                result = await store.reserve(f"r{i}", [], 0, now=float(i), budgets=[soft],
                                             money=amount)
                assert result.budget_spent == (sum(amounts[:i + 1]),)
            for i in range(len(amounts)):
                await store.reconcile(f"r{i}", 0, actual_money=0)
            assert int(await client.get(f"{store.budget_base(soft)}:t")) == 0
        finally:
            await client.aclose()

    asyncio.run(main())


async def test_a_budget_over_100000_units_admits_through_the_policy(
        store: QuotaStore) -> None:
    """The reported case, through the admission policy: a budget of 100,001
    units and a priced model; the request is admitted, its header exact."""
    budgets = BudgetSet()
    budget = Budget("acme", Decimal("100001"), period="month")
    budgets.put(budget)
    config = from_dict({"models": [{"name": "m", "price_input": 3.0, "price_output": 15.0}]})
    admission = QuotaAdmission(store, PolicySet(), config.model_index(), fail_open=False,
                               budgets=budgets, prices=PriceBook(config),
                               spend=config.spend, clock=lambda: 1_800_000_000.0)
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    decision = await admission.admit(Request(
        id="big", reply="x", model="m", api=Api.CHAT, stream=False, body=body,
        created_ms=0, deadline_ms=0, window_bytes=1, window_msgs=1, tenant="acme"))
    assert decision.admission is Admission.ADMITTED
    cost = Price("m", input=Decimal(3), output=Decimal(15)).cost(
        estimate_prompt_tokens(Api.CHAT, body), 5)
    assert decision.headers["x-ratelimit-remaining-budget"] == format_money(
        budget.nanos - cost)
