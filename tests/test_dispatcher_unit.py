"""The dispatcher's decisions (dispatcher/service.py) and quota admission
(dispatcher/admission.py) as unit tests with fakes behind their seams: the
request message (``data``, ``metadata``, ``ack``/``nak``/``term``), the NATS
client and JetStream context (``publish``), the admission policy
(``AdmissionPolicy``) and the quota store (``dispatcher.quota.Quotas``).

Each test asserts what the edge is told (the Status on the reply subject),
whether a job is published (and with which headers) and the request
message's fate; the order "job published, then request acked" is what
makes a dispatcher crash lose nothing. The same paths run against real
servers in test_quotas_pipeline.py and test_promises.py.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import nats.errors
import pytest

from dispatcher.admission import ADMIT, Decision, QuotaAdmission
from dispatcher.quota import BudgetCharge, QuotaResult, QuotaUnavailable, Scope
from dispatcher.service import Dispatcher
from tidegate import config as tgconfig
from tidegate.control.policies import Policy, PolicySet
from tidegate.wire import classes
from tidegate.wire.protocol import (
    RESERVED_HEADER,
    Admission,
    Api,
    ErrorInfo,
    Request,
    Status,
    decode_session,
)

CONFIG = tgconfig.from_dict({"models": [{"name": "m", "simulator": {}}]})
SUBJECTS = CONFIG.nats.subjects


class Log:
    """One ordered record of everything the dispatcher did."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


class FakeMsg:
    def __init__(self, log: Log, data: bytes, delivered: int = 1) -> None:
        self.log, self.data = log, data
        self.metadata = SimpleNamespace(num_delivered=delivered)
        self.headers: dict[str, str] = {}

    async def ack(self) -> None:
        self.log.events.append(("ack", None))

    async def nak(self, delay: float | None = None) -> None:
        self.log.events.append(("nak", delay))

    async def term(self) -> None:
        self.log.events.append(("term", None))


class FakeNats:
    def __init__(self, log: Log) -> None:
        self.log = log

    async def publish(self, subject: str, payload: bytes,
                      headers: dict[str, str] | None = None) -> None:
        self.log.events.append(("status", (subject, decode_session(payload))))


class FakeJetStream:
    def __init__(self, log: Log, fail: bool = False) -> None:
        self.log, self.fail = log, fail

    async def publish(self, subject: str, payload: bytes,
                      headers: dict[str, str] | None = None) -> Any:
        if self.fail:
            raise nats.errors.TimeoutError
        self.log.events.append(("job", (subject, payload, dict(headers or {}))))
        return SimpleNamespace(seq=1, duplicate=False)


class FixedPolicy:
    def __init__(self, decision: Decision | Exception) -> None:
        self.decision = decision
        self.refunded: list[str] = []

    async def admit(self, request: Request) -> Decision:
        if isinstance(self.decision, Exception):
            raise self.decision
        return self.decision

    async def refund(self, request_id: str) -> None:
        self.refunded.append(request_id)


def request(**changes: Any) -> Request:
    now_ms = int(time.time() * 1000)
    fields: dict[str, Any] = dict(
        id="r1", reply=SUBJECTS.out("e1", "r1"), model="m", api=Api.CHAT, stream=True,
        body={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
        created_ms=now_ms, deadline_ms=now_ms + 60_000, window_bytes=1 << 16,
        window_msgs=128, tenant="acme")
    fields.update(changes)
    return Request(**fields)


def make(decision: Decision | Exception = ADMIT, fail_publish: bool = False,
         ) -> tuple[Dispatcher, Log]:
    log = Log()
    dispatcher = Dispatcher(CONFIG, FakeNats(log), FakeJetStream(log, fail_publish),  # type: ignore[arg-type]
                            FixedPolicy(decision))
    return dispatcher, log


def statuses(log: Log) -> list[Status]:
    return [payload for name, (_, payload) in
            ((n, e) for n, e in log.events if n == "status")]


# -- Dispatcher.handle -----------------------------------------------------------------


async def test_admitted_status_then_job_then_ack() -> None:
    dispatcher, log = make(Decision(Admission.ADMITTED, headers={"x-ratelimit-limit-tokens": "9"},
                                    reserved=True))
    req = request()
    await dispatcher.handle(FakeMsg(log, req.encode()))  # type: ignore[arg-type]
    assert log.names() == ["status", "job", "ack"], "the request is acked only after its job"
    subject, status = log.events[0][1]
    assert subject == req.reply
    assert status.admission is Admission.ADMITTED
    assert status.headers == {"x-ratelimit-limit-tokens": "9"}
    job_subject, payload, headers = log.events[1][1]
    assert job_subject == SUBJECTS.job("m")
    assert payload == req.encode()
    assert headers["Nats-Msg-Id"] == "r1", "a request dispatched twice runs once"
    assert headers[RESERVED_HEADER] == "1"


async def test_unreserved_job_carries_no_reserved_header() -> None:
    dispatcher, log = make(ADMIT)
    await dispatcher.handle(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    _, _, headers = next(e for n, e in log.events if n == "job")
    assert RESERVED_HEADER not in headers


class TieredGate:
    """The queue gate, as far as dispatching reads it: acme's tier weighs 4."""

    def weight(self, tenant: str) -> float:
        return 4.0 if tenant == "acme" else 1.0

    async def admit(self, *_: Any) -> bool:
        return True

    def preempt_for(self, request: Request, model: Any) -> None:
        return None


@pytest.mark.parametrize(("tenant", "weight"), [("acme", "4.0"), ("other", None)])
async def test_a_tiered_tenants_job_carries_its_weight(tenant: str, weight: str | None) -> None:
    """Read by a worker deciding whose stream gives way (workers.preemption);
    the default weight, 1, goes unsaid."""
    dispatcher, log = make(ADMIT)
    dispatcher.gate = TieredGate()  # type: ignore[assignment]
    await dispatcher.handle(FakeMsg(log, request(tenant=tenant).encode()))  # type: ignore[arg-type]
    _, _, headers = next(e for n, e in log.events if n == "job")
    assert headers.get(classes.WEIGHT_HEADER) == weight


async def test_rejected_gets_its_error_and_no_job() -> None:
    error = ErrorInfo(429, "rate_limit_error", "rate_limit_tokens", "slow down", True, 12.0)
    dispatcher, log = make(Decision(Admission.REJECTED, error=error,
                                    headers={"x-ratelimit-remaining-tokens": "0"}))
    await dispatcher.handle(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert log.names() == ["status", "ack"]
    [status] = statuses(log)
    assert status.admission is Admission.REJECTED
    assert status.error == error
    assert status.headers == {"x-ratelimit-remaining-tokens": "0"}


async def test_job_publish_failure_naks_for_a_retry_and_never_acks() -> None:
    dispatcher, log = make(ADMIT, fail_publish=True)
    await dispatcher.handle(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert "ack" not in log.names()
    assert log.events[-1][0] == "nak"


async def test_expired_request_is_dropped_without_asking_anyone() -> None:
    dispatcher, log = make(RuntimeError("the policy must not be asked"))
    past = int(time.time() * 1000) - 1
    await dispatcher.handle(FakeMsg(log, request(deadline_ms=past).encode()))  # type: ignore[arg-type]
    assert log.names() == ["ack"]


async def test_cancelled_request_is_dropped() -> None:
    dispatcher, log = make(RuntimeError("the policy must not be asked"))
    dispatcher.on_cancel("r1", "client_disconnected")
    await dispatcher.handle(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert log.names() == ["ack"]


@pytest.mark.parametrize("reply", ["tg.elsewhere.r1", "$JS.API.STREAM.DELETE.X"])
async def test_reply_outside_the_edge_inboxes_is_terminated_unanswered(reply: str) -> None:
    dispatcher, log = make()
    await dispatcher.handle(FakeMsg(log, request(reply=reply).encode()))  # type: ignore[arg-type]
    assert log.names() == ["term"]


async def test_malformed_request_is_terminated() -> None:
    dispatcher, log = make()
    await dispatcher.handle(FakeMsg(log, b"\x93not a request"))  # type: ignore[arg-type]
    assert log.names() == ["term"]


@pytest.mark.parametrize("failure", [QuotaUnavailable("redis exploded"),
                                     nats.errors.TimeoutError(), ConnectionError("reset")])
async def test_a_transient_failure_leaves_the_request_for_redelivery(
        failure: Exception) -> None:
    dispatcher, log = make(failure)
    await dispatcher.handle_safely(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert log.names() == [], "neither acked nor answered: JetStream redelivers it"


async def test_any_other_failure_is_poison_answered_400_and_terminated() -> None:
    """tidegate.broker.poison: a failure of the message itself would come back
    forever; the edge gets a 400 and the message is terminated."""
    dispatcher, log = make(OverflowError("cannot convert float infinity to integer"))
    await dispatcher.handle_safely(FakeMsg(log, request().encode()))  # type: ignore[arg-type]
    assert log.names() == ["status", "term"]
    subject, status = log.events[0][1]
    assert subject == SUBJECTS.out("e1", "r1")
    assert status.admission is Admission.REJECTED
    assert (status.error.status, status.error.code) == (400, "unprocessable_request")
    # terminated before any job: what the policy reserved is refunded
    assert dispatcher.policy.refunded == ["r1"]  # type: ignore[attr-defined]


# -- QuotaAdmission -------------------------------------------------------------------


class FakeQuotas:
    def __init__(self, result: QuotaResult | None = None) -> None:
        self.result = result
        self.calls: list[tuple[str, list[str], int]] = []

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int,
                      now: float | None = None, budgets: Sequence[BudgetCharge] = (),
                      money: int = 0) -> QuotaResult:
        self.calls.append((request_id, [s.id for s in scopes], tokens))
        if self.result is None:
            raise QuotaUnavailable("connection refused")
        return self.result

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None, actual_money: int = 0) -> None:
        pass

    async def release(self, request_id: str) -> None:
        pass


def admission(store: FakeQuotas, *policies: Policy, fail_open: bool = False) -> QuotaAdmission:
    return QuotaAdmission(store, PolicySet(policies), CONFIG.model_index(), fail_open=fail_open)


async def test_no_applicable_policy_admits_without_the_store() -> None:
    store = FakeQuotas()
    decision = await admission(store, Policy(tenant="other", rpm=1)).admit(request())
    assert decision == ADMIT
    assert not decision.reserved
    assert store.calls == []


async def test_admitted_reserves_in_every_applicable_scope_with_headers() -> None:
    store = FakeQuotas(QuotaResult(True, limit_requests=100, remaining_requests=99,
                                   reset_requests=0.6, limit_tokens=5000,
                                   remaining_tokens=3000, reset_tokens=61.0))
    decision = await admission(store, Policy(tenant="acme", tpm=5000),
                               Policy(model="m", rpm=100)).admit(request())
    assert decision.admission is Admission.ADMITTED
    assert decision.reserved
    [(request_id, scopes, tokens)] = store.calls
    assert request_id == "r1"
    assert len(scopes) == 2
    assert tokens > 0
    assert decision.headers == {
        "x-ratelimit-limit-requests": "100", "x-ratelimit-remaining-requests": "99",
        "x-ratelimit-reset-requests": "1s", "x-ratelimit-limit-tokens": "5000",
        "x-ratelimit-remaining-tokens": "3000", "x-ratelimit-reset-tokens": "1m1s"}


async def test_over_the_limit_is_429_retryable_with_retry_after() -> None:
    store = FakeQuotas(QuotaResult(False, limit="tokens", scope="tenant.acme", retry_after=7.5,
                                   limit_tokens=100, remaining_tokens=3, reset_tokens=60))
    decision = await admission(store, Policy(tenant="acme", tpm=100)).admit(request())
    assert decision.admission is Admission.REJECTED
    assert decision.error is not None
    assert (decision.error.status, decision.error.code, decision.error.retryable,
            decision.error.retry_after) == (429, "rate_limit_tokens", True, 7.5)
    assert decision.headers["x-ratelimit-remaining-tokens"] == "3"


async def test_too_large_for_the_limit_is_429_and_not_retryable() -> None:
    store = FakeQuotas(QuotaResult(False, limit="tokens", scope="tenant.acme", too_large=True,
                                   limit_tokens=100, remaining_tokens=100))
    decision = await admission(store, Policy(tenant="acme", tpm=100)).admit(request())
    assert decision.error is not None
    assert (decision.error.code, decision.error.retryable, decision.error.retry_after) == (
        "request_too_large_for_limit", False, 0.0)


async def test_store_down_fails_closed_with_503() -> None:
    decision = await admission(FakeQuotas(None), Policy(tenant="acme", rpm=5)).admit(request())
    assert decision.admission is Admission.REJECTED
    assert decision.error is not None
    assert (decision.error.status, decision.error.code, decision.error.retryable) == (
        503, "quota_store_unavailable", True)


async def test_store_down_fails_open_when_configured() -> None:
    decision = await admission(FakeQuotas(None), Policy(tenant="acme", rpm=5),
                               fail_open=True).admit(request())
    assert decision == ADMIT
    assert not decision.reserved, "nothing was reserved, nothing to reconcile"
