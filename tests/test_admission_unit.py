"""dispatcher.admission without Redis: what a refused client reads, and the
undo of reservations made in doubt (a reserve or refund that failed while
the quota store was out), on a virtual clock.

Against a real redis-server: tests/test_quota.py, tests/test_refunds.py,
tests/test_promises_admission.py (partitions and outages).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from decimal import Decimal
from types import SimpleNamespace

import pytest

from dispatcher import admission as adm
from dispatcher.admission import (
    QuotaAdmission,
    _budget_rejection,
    _duration,
    _rejection,
    rate_limit_headers,
)
from dispatcher.quota import BudgetCharge, Limits, QuotaResult, QuotaUnavailable, Scope
from tests.test_dispatcher_unit import FakeQuotas, admission, request
from tidegate import config as tgconfig
from tidegate.apis import estimate_prompt_tokens, reservation
from tidegate.control.budgets import Budget, BudgetSet, period_window
from tidegate.control.policies import BATCH_SCOPE, Policy, PolicySet
from tidegate.control.prices import PriceBook
from tidegate.telemetry import telemetry as tm
from tidegate.wire.protocol import Admission, Api, ErrorInfo

_real_sleep = asyncio.sleep


@pytest.mark.parametrize(("seconds", "text"), [
    (0.2, "1s"), (59.0, "59s"), (60.0, "1m0s"), (360.0, "6m0s"), (3723.0, "1h2m3s"),
    (3600.0, "1h0m0s"), (-4.0, "0s"),
])
def test_reset_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert _duration(seconds) == text


def test_a_rate_limit_says_which_limit_of_which_scope_and_when() -> None:
    assert _rejection(QuotaResult(False, limit="requests", scope="tenant.acme",
                                  retry_after=7.5), 1234) == ErrorInfo(
        429, "rate_limit_error", "rate_limit_requests",
        "Rate limit reached for requests per minute (scope 'tenant.acme'). "
        "Please try again in 8s.", True, 7.5)
    # retry_after is never 0: a client told 0 retries at once, in a loop
    assert _rejection(QuotaResult(False, limit="concurrency", scope="tenant.acme"),
                      1234) == ErrorInfo(
        429, "rate_limit_error", "rate_limit_concurrency",
        "Rate limit reached for concurrent streams (scope 'tenant.acme'). "
        "Please try again in 0s.", True, 0.001)
    assert _rejection(QuotaResult(False, limit="tokens", scope="model.m", too_large=True),
                      1234) == ErrorInfo(
        429, "rate_limit_error", "request_too_large_for_limit",
        "Request too large: it reserves 1234 tokens (prompt estimate + max_tokens), more "
        "than the tokens per minute limit of scope 'model.m'. Lower max_tokens or shorten "
        "the prompt.")


def test_a_budget_refusal_names_the_budget_the_cost_and_the_reset() -> None:
    budget = Budget(tenant="acme", amount=Decimal("5"))
    assert _budget_rejection(QuotaResult(False, limit="budget", scope=budget.budget_id,
                                         retry_after=3700.2), budget, 1_500_000_000,
                             "USD") == ErrorInfo(
        429, "insufficient_quota", "budget_exceeded",
        "Budget exceeded for tenant 'acme', per month: this request may cost up to 1.5 USD, "
        "more than is left. The budget resets in 1h1m41s.", True, 3700.2)
    assert _budget_rejection(QuotaResult(False, limit="budget", scope="s", retry_after=-1),
                             None, 1, "EUR").retry_after == 0.001
    assert _budget_rejection(QuotaResult(False, limit="budget", scope="the-scope",
                                         too_large=True), None, 6_000_000_000,
                             "EUR") == ErrorInfo(
        429, "insufficient_quota", "budget_exceeded",
        "Budget exceeded: this request may cost up to 6 EUR (prompt estimate + max_tokens at "
        "the model's price), more than the whole budget of the-scope. Lower max_tokens or "
        "shorten the prompt.")


async def test_a_store_outage_refuses_with_a_503_to_retry_shortly() -> None:
    decision = await admission(FakeQuotas(None), Policy(tenant="acme", rpm=5)).admit(request())
    assert decision.error == ErrorInfo(
        503, "service_unavailable", "quota_store_unavailable",
        "Rate limits cannot be checked right now (quota store unavailable); retry shortly.",
        True, 2.0)


@pytest.fixture
def new_york(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The host's local time is not UTC: a reset must still be written in UTC."""
    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_the_messages_api_gets_anthropics_headers_too(monkeypatch: pytest.MonkeyPatch,
                                                      new_york: None) -> None:
    monkeypatch.setattr(adm.time, "time", lambda: 1_700_000_000.0)  # 2023-11-14T22:13:20Z
    result = QuotaResult(True, limit_requests=10, remaining_requests=-1, reset_requests=59.5,
                         limit_tokens=500, remaining_tokens=0, reset_tokens=-3.0)
    headers = rate_limit_headers(result, anthropic=True)
    assert (headers["x-ratelimit-remaining-requests"],
            headers["x-ratelimit-remaining-tokens"]) == ("0", "0")
    assert {k: v for k, v in headers.items() if k.startswith("anthropic-")} == {
        "anthropic-ratelimit-requests-limit": "10",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:14:19Z",
        "anthropic-ratelimit-tokens-limit": "500",
        "anthropic-ratelimit-tokens-remaining": "0",
        "anthropic-ratelimit-tokens-reset": "2023-11-14T22:13:20Z"}
    assert headers["x-ratelimit-reset-requests"] == "1m0s"
    assert not [k for k in rate_limit_headers(result) if k.startswith("anthropic-")]


class Recorder:
    def __init__(self) -> None:
        self.adds: list[tuple[int, dict[str, str]]] = []

    def add(self, n: int, attributes: dict[str, str]) -> None:
        self.adds.append((n, attributes))


@pytest.fixture
def metrics(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    m = SimpleNamespace(quota_rejections=Recorder(), budget_alerts=Recorder())
    monkeypatch.setattr(adm.tm, "get", lambda: SimpleNamespace(metrics=m))
    return m


async def test_an_outage_refusal_is_counted_and_logged_once_in_a_while(
        metrics: SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="tidegate.dispatcher")
    closed = admission(FakeQuotas(None), Policy(tenant="acme", rpm=5))
    for rid in ("r1", "r2", "r3"):
        decision = await closed.admit(request(id=rid))
        assert decision.error is not None
        assert decision.error.code == "quota_store_unavailable"
    assert metrics.quota_rejections.adds == [
        (1, {tm.LIMIT: "store_unavailable", tm.MODEL: "m"})] * 3
    assert len([r for r in caplog.records if "quota store unavailable" in r.message]) == 1
    opened = admission(FakeQuotas(None), Policy(tenant="acme", rpm=5), fail_open=True)
    await opened.admit(request())
    assert len(metrics.quota_rejections.adds) == 3, "admitted without quotas: no refusal"


def test_a_budget_alert_is_counted_at_each_threshold_crossed(metrics: SimpleNamespace) -> None:
    policy = admission(FakeQuotas(None))
    budget = Budget(tenant="acme", amount=Decimal("10"))
    soft = Budget(tenant="acme", amount=Decimal("10"), soft=True, user="u")
    nano = 1_000_000_000
    policy._alert([budget], (7 * nano,), nano)  # 6 -> 7 of 10: no threshold
    assert metrics.budget_alerts.adds == []
    policy._alert([budget, soft], (8 * nano, 21 * nano // 2), nano)  # 7 -> 8; 9.5 -> 10.5
    assert metrics.budget_alerts.adds == [
        (1, {tm.BUDGET: budget.budget_id, tm.THRESHOLD: "0.8"}),
        (1, {tm.BUDGET: soft.budget_id, tm.THRESHOLD: "1.0"})]
    metrics.budget_alerts.adds.clear()
    policy._alert([budget], (10 * nano,), 3 * nano)  # 7 -> 10: both at once
    assert metrics.budget_alerts.adds == [
        (1, {tm.BUDGET: budget.budget_id, tm.THRESHOLD: "0.8"}),
        (1, {tm.BUDGET: budget.budget_id, tm.THRESHOLD: "1.0"})]


class RecordingQuotas(FakeQuotas):
    """Keeps every argument of every reserve; reconciles are recorded too."""

    def __init__(self, result: QuotaResult | Exception) -> None:
        super().__init__(None)
        self.answer = result
        self.reserves: list[dict[str, object]] = []
        self.reconciles: list[tuple[str, int]] = []

    async def reserve(self, request_id: str, scopes: object, tokens: int,
                      now: float | None = None, budgets: object = (),
                      money: int = 0) -> QuotaResult:
        self.reserves.append({"id": request_id, "scopes": list(scopes),  # type: ignore[call-overload]
                              "tokens": tokens, "now": now, "budgets": list(budgets),  # type: ignore[call-overload]
                              "money": money})
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None, actual_money: int = 0) -> None:
        self.reconciles.append((request_id, actual_tokens))


NOW = 1_780_000_000.0
SPEND_CONFIG = tgconfig.from_dict({
    "models": [{"name": "m", "simulator": {}, "reserve_max_tokens": 300,
                "price_input": 2.0, "price_output": 8.0},
               {"name": "free", "simulator": {}}],
    "spend": {"currency": "EUR"}})
TENANT = Policy(tenant="acme", rpm=5, tpm=1000, concurrency=2)
USER = Policy(tenant="acme", user="u1", rpm=7)
BATCH = Policy(tenant="acme", model=BATCH_SCOPE, tpm=50)
WHOLE = Budget(tenant="acme", amount=Decimal("10"))
PER_KEY = Budget(tenant="acme", amount=Decimal("3"), key="k1", soft=True)
PER_USER = Budget(tenant="acme", amount=Decimal("4"), user="u1")
PER_MODEL = Budget(tenant="acme", amount=Decimal("6"), model="m")


def spend_policy(store: FakeQuotas) -> QuotaAdmission:
    budgets = BudgetSet()
    for b in (WHOLE, PER_KEY, PER_USER, PER_MODEL):
        budgets.put(b)
    return QuotaAdmission(store, PolicySet((TENANT, USER, BATCH)), SPEND_CONFIG.model_index(),
                          fail_open=False, budgets=budgets, prices=PriceBook(SPEND_CONFIG),
                          spend=SPEND_CONFIG.spend, clock=lambda: NOW)


def charge(b: Budget) -> BudgetCharge:
    period = period_window(b, NOW, spend_policy(FakeQuotas()).tz)
    return BudgetCharge(b.budget_id, b.nanos, period.label, b.window, period.reset_in,
                        period.ttl, b.soft)


async def test_admit_reserves_every_scope_budget_and_the_most_the_request_can_cost() -> None:
    """What reaches the store is what is enforced: every applicable policy
    with its limits, the tokens (the model's reserve cap when max_tokens is
    absent), the clock, every applicable budget and the money."""
    store = RecordingQuotas(QuotaResult(True, limit_requests=7, remaining_requests=6,
                                        reset_requests=1.0))
    body = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}
    decision = await spend_policy(store).admit(request(body=body, user="u1", key_id="k1",
                                                       api=Api.MESSAGES))
    assert decision.admission is Admission.ADMITTED
    tokens = reservation(Api.MESSAGES, body, 300)
    prompt = min(estimate_prompt_tokens(Api.MESSAGES, body), tokens)
    price = PriceBook(SPEND_CONFIG).get("m")
    assert price is not None
    [call] = store.reserves
    charges = sorted(call.pop("budgets"), key=lambda c: c.id)  # type: ignore[attr-defined]
    assert charges == sorted([charge(b) for b in (PER_USER, PER_KEY, PER_MODEL, WHOLE)],
                             key=lambda c: c.id)
    assert call == {
        "id": "r1",
        "scopes": [Scope(USER.scope_id, Limits(rpm=7)),
                   Scope(TENANT.scope_id, Limits(rpm=5, tpm=1000, concurrency=2))],
        "tokens": tokens, "now": NOW, "money": price.cost(prompt, tokens - prompt)}
    assert decision.headers["anthropic-ratelimit-requests-limit"] == "7"


async def test_a_batch_line_is_held_to_the_batch_policies_too() -> None:
    store = RecordingQuotas(QuotaResult(True))
    await spend_policy(store).admit(request(klass="batch"))
    await spend_policy(store).admit(request())
    batch, interactive = ([s.id for s in r["scopes"]] for r in store.reserves)  # type: ignore[attr-defined]
    assert batch == [TENANT.scope_id, BATCH.scope_id]
    assert interactive == [TENANT.scope_id]


async def test_without_budgets_or_a_price_no_money_is_reserved() -> None:
    store = RecordingQuotas(QuotaResult(True))
    await admission(store, TENANT).admit(request(model="other"))  # no model: cap 1024
    no_price = QuotaAdmission(store, PolicySet((TENANT,)), SPEND_CONFIG.model_index(),
                              fail_open=False, budgets=spend_policy(store).budgets)
    await no_price.admit(request(model="free"))
    unknown, free = store.reserves
    assert (unknown["budgets"], unknown["money"]) == ([], 0)
    assert unknown["tokens"] == reservation(Api.CHAT, request().body, 1024)
    assert free["money"] == 0
    assert [c.id for c in free["budgets"]] == [WHOLE.budget_id]  # type: ignore[attr-defined]


async def test_a_refusal_names_the_budget_or_the_tokens_and_is_counted(
        metrics: SimpleNamespace) -> None:
    store = RecordingQuotas(QuotaResult(False, limit="budget", scope=PER_USER.budget_id,
                                        retry_after=60.0))
    refused = await spend_policy(store).admit(request(user="u1"))
    assert refused.error is not None
    assert PER_USER.label in refused.error.message
    assert " EUR, more than is left" in refused.error.message
    store = RecordingQuotas(QuotaResult(False, limit="tokens", scope=TENANT.scope_id,
                                        too_large=True))
    refused = await spend_policy(store).admit(request())
    assert refused.error is not None
    tokens = store.reserves[0]["tokens"]
    assert f"it reserves {tokens} tokens" in refused.error.message
    assert metrics.quota_rejections.adds == [(1, {tm.LIMIT: "budget", tm.MODEL: "m"}),
                                             (1, {tm.LIMIT: "tokens", tm.MODEL: "m"})]


async def test_a_reserve_that_failed_otherwise_is_refunded_at_once() -> None:
    store = RecordingQuotas(RuntimeError("a reply nobody can parse"))
    with pytest.raises(RuntimeError):
        await spend_policy(store).admit(request())
    assert store.reconciles == [("r1", 0)]


# -- undoing what was reserved in doubt -----------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await _real_sleep(0)


class FlakyQuotas(FakeQuotas):
    """Reconciles fail while ``down``; every attempt is recorded with its time."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(None)
        self.clock = clock
        self.down = True
        self.attempts: list[tuple[str, float, bool]] = []

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None, actual_money: int = 0) -> None:
        assert actual_tokens == 0
        assert actual_money == 0
        self.attempts.append((request_id, self.clock.now - 1000.0, not self.down))
        if self.down:
            raise QuotaUnavailable("connection refused")


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(adm.time, "monotonic", lambda: c.now)
    monkeypatch.setattr(adm.asyncio, "sleep", c.sleep)
    return c


async def until(done: object, steps: int = 5000) -> None:
    for _ in range(steps):
        if done():  # type: ignore[operator]
            return
        await _real_sleep(0)
    raise AssertionError("never")


def quota(store: FakeQuotas) -> QuotaAdmission:
    return admission(store, Policy(tenant="acme", rpm=5))


async def test_a_reserve_in_doubt_is_undone_when_the_store_answers_then_again_later(
        clock: Clock) -> None:
    """A reserve sent over a cut link may still arrive after the heal: undone
    at once, then at each of REDO s after, backing off while the store is out."""
    store = FlakyQuotas(clock)
    policy = quota(store)
    decision = await policy.admit(request())
    assert decision.admission is Admission.REJECTED
    await until(lambda: len(store.attempts) >= 5)
    store.down = False
    task = policy._undoing
    assert task is not None
    await until(task.done)
    failed = [t for _, t, ok in store.attempts if not ok]
    assert failed[:5] == [0.0, 1.0, 3.0, 7.0, 12.0]  # 1, 2, 4, then at most 5 s apart
    undone = [t for _, t, ok in store.attempts if ok]
    first = undone[0]
    assert [t - first for t in undone] == [0.0, 5.0, 20.0, 65.0, 185.0]
    assert {rid for rid, _, _ in store.attempts} == {"r1"}
    assert not policy._doubtful


async def test_a_refund_that_failed_is_retried_and_one_that_did_is_not(clock: Clock) -> None:
    store = FlakyQuotas(clock)
    policy = quota(store)
    store.down = False
    await policy.refund("done")
    assert policy._undoing is None
    assert not policy._doubtful
    store.down = True
    await policy.refund("later")
    assert "later" in policy._doubtful
    store.down = False
    task = policy._undoing
    assert task is not None
    await until(task.done)
    assert [rid for rid, _, ok in store.attempts if ok] == ["done"] + ["later"] * 5


async def test_doubts_are_bounded_and_share_one_undoing_task(
        clock: Clock, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adm, "MAX_DOUBTFUL", 2)
    store = FlakyQuotas(clock)
    policy = quota(store)
    for rid in ("a", "b", "c"):
        await policy.refund(rid)
    assert list(policy._doubtful) == ["a", "b"], "past the bound, the lease expiry frees it"
    assert policy._doubtful["a"] == (0, 0.0), "undone at once, no undo done yet"
    first = policy._undoing
    await policy.refund("a")
    assert policy._undoing is first
    assert first is not None
    first.cancel()


async def test_a_refused_request_raises_no_budget_alert(metrics: SimpleNamespace) -> None:
    """The store reports what was spent even when it refuses; only an admitted
    reservation moves spending across an alert threshold."""
    budgets = BudgetSet()
    budgets.put(WHOLE)
    spent = (WHOLE.nanos * 8 // 10,)  # exactly at 80 %: the reservation would have crossed it
    refused = RecordingQuotas(QuotaResult(False, limit="tokens", scope=TENANT.scope_id,
                                          retry_after=1.0, budget_spent=spent))
    policy = QuotaAdmission(refused, PolicySet((TENANT,)), SPEND_CONFIG.model_index(),
                            fail_open=False, budgets=budgets, prices=PriceBook(SPEND_CONFIG),
                            spend=SPEND_CONFIG.spend, clock=lambda: NOW)
    await policy.admit(request())
    assert metrics.budget_alerts.adds == []
    policy.store = RecordingQuotas(QuotaResult(True, budget_spent=spent))
    await policy.admit(request())
    assert metrics.budget_alerts.adds == [(1, {tm.BUDGET: WHOLE.budget_id, tm.THRESHOLD: "0.8"})]
