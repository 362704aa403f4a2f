"""dispatcher.admission without Redis: what a refused client reads, and the
undo of reservations made in doubt (a reserve or refund that failed while
the quota store was out), on a virtual clock.

Against a real redis-server: tests/test_quota.py, tests/test_refunds.py,
tests/test_promises_admission.py (partitions and outages).
"""

from __future__ import annotations

import asyncio
import logging
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
from dispatcher.quota import QuotaResult, QuotaUnavailable
from tests.test_dispatcher_unit import FakeQuotas, admission, request
from tidegate.control.budgets import Budget
from tidegate.control.policies import Policy
from tidegate.telemetry import telemetry as tm
from tidegate.wire.protocol import Admission, ErrorInfo

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


def test_the_messages_api_gets_anthropics_headers_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adm.time, "time", lambda: 1_700_000_000.0)  # 2023-11-14T22:13:20Z
    result = QuotaResult(True, limit_requests=10, remaining_requests=-1, reset_requests=59.5,
                         limit_tokens=500, remaining_tokens=20, reset_tokens=-3.0)
    headers = rate_limit_headers(result, anthropic=True)
    assert {k: v for k, v in headers.items() if k.startswith("anthropic-")} == {
        "anthropic-ratelimit-requests-limit": "10",
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2023-11-14T22:14:19Z",
        "anthropic-ratelimit-tokens-limit": "500",
        "anthropic-ratelimit-tokens-remaining": "20",
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
