"""Admission policy: the seam where quotas and queue mode plug in.

The dispatcher loop asks an :class:`AdmissionPolicy` about every request and
acts on the :class:`Decision`; it never decides anything itself.

* :class:`AdmitAll` admits everything (no policies configured).
* :class:`QuotaAdmission` reserves the request's estimated tokens in every
  applicable policy scope with one Redis round trip (``dispatcher.quota``),
  and answers 429 with OpenAI's rate-limit headers when a limit is hit. When
  Redis is unavailable it fails closed (503) or open (admit, loudly), as
  ``dispatcher.quota_failure`` says. A reserve that failed may still have run
  in Redis (a partition that took only its answer): it is undone once Redis
  answers again, so quotas are exact after the heal instead of holding a
  concurrency slot until its lease expires (30 min).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zoneinfo
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Protocol

from dispatcher.quota import BudgetCharge, Limits, QuotaResult, Quotas, QuotaUnavailable, Scope
from tidegate import apis
from tidegate.apis import estimate_prompt_tokens, reservation
from tidegate.config import ModelConfig, SpendConfig
from tidegate.control.budgets import Budget, BudgetSet, period_window
from tidegate.control.policies import PolicySet
from tidegate.control.prices import PriceBook, format_money
from tidegate.telemetry import telemetry as tm
from tidegate.wire.protocol import Admission, ErrorInfo, Request

log = logging.getLogger("tidegate.dispatcher")


@dataclass(frozen=True, slots=True)
class Decision:
    admission: Admission
    position: int = 0
    error: ErrorInfo | None = None
    headers: dict[str, str] = field(default_factory=dict)
    reserved: bool = False  # quota was reserved: its usage must be reconciled


ADMIT = Decision(Admission.ADMITTED)


class AdmissionPolicy(Protocol):
    async def admit(self, request: Request) -> Decision: ...

    async def refund(self, request_id: str) -> None:
        """Undo whatever :meth:`admit` reserved for the request: it will not
        run (no job was published and its message will not come back). Never
        raises for an outage; does nothing when nothing was reserved."""
        ...


class AdmitAll:
    """Admits every request."""

    async def admit(self, request: Request) -> Decision:
        return ADMIT

    async def refund(self, request_id: str) -> None:
        pass


def _duration(seconds: float) -> str:
    """OpenAI's reset format: "1s", "6m0s", "1h2m3s"."""
    seconds = max(0, math.ceil(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def rate_limit_headers(result: QuotaResult, *, anthropic: bool = False) -> dict[str, str]:
    """OpenAI's ``x-ratelimit-*`` headers; for Anthropic's Messages API
    (``anthropic``) also its ``anthropic-ratelimit-*`` names, whose reset is
    the RFC 3339 time of the reset rather than a duration."""
    headers: dict[str, str] = {}
    if anthropic:
        now = time.time()
        for kind, limit, remaining, reset in (
                ("requests", result.limit_requests, result.remaining_requests,
                 result.reset_requests),
                ("tokens", result.limit_tokens, result.remaining_tokens, result.reset_tokens)):
            if limit:
                at = datetime.fromtimestamp(now + max(0.0, reset), UTC)
                headers[f"anthropic-ratelimit-{kind}-limit"] = str(limit)
                headers[f"anthropic-ratelimit-{kind}-remaining"] = str(max(0, remaining))
                headers[f"anthropic-ratelimit-{kind}-reset"] = at.strftime("%Y-%m-%dT%H:%M:%SZ")
    if result.remaining_budget >= 0:
        headers["x-ratelimit-remaining-budget"] = format_money(result.remaining_budget)
    if result.limit_requests:
        headers["x-ratelimit-limit-requests"] = str(result.limit_requests)
        headers["x-ratelimit-remaining-requests"] = str(max(0, result.remaining_requests))
        headers["x-ratelimit-reset-requests"] = _duration(result.reset_requests)
    if result.limit_tokens:
        headers["x-ratelimit-limit-tokens"] = str(result.limit_tokens)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, result.remaining_tokens))
        headers["x-ratelimit-reset-tokens"] = _duration(result.reset_tokens)
    return headers


_LIMIT_NAMES = {"requests": "requests per minute", "tokens": "tokens per minute",
                "concurrency": "concurrent streams"}


def _budget_rejection(result: QuotaResult, budget: Budget | None, money: int,
                      currency: str) -> ErrorInfo:
    label = budget.label if budget is not None else result.scope
    if result.too_large:
        message = (f"Budget exceeded: this request may cost up to {format_money(money)} "
                   f"{currency} (prompt estimate + max_tokens at the model's price), more than "
                   f"the whole budget of {label}. Lower max_tokens or shorten the prompt.")
        return ErrorInfo(429, "insufficient_quota", "budget_exceeded", message)
    message = (f"Budget exceeded for {label}: this request may cost up to "
               f"{format_money(money)} {currency}, more than is left. The budget resets in "
               f"{_duration(result.retry_after)}.")
    return ErrorInfo(429, "insufficient_quota", "budget_exceeded", message, True,
                     max(result.retry_after, 0.001))


def _rejection(result: QuotaResult, tokens: int) -> ErrorInfo:
    what = _LIMIT_NAMES.get(result.limit, result.limit)
    if result.too_large:
        message = (f"Request too large: it reserves {tokens} tokens (prompt estimate + "
                   f"max_tokens), more than the {what} limit of scope '{result.scope}'. "
                   "Lower max_tokens or shorten the prompt.")
        return ErrorInfo(429, "rate_limit_error", "request_too_large_for_limit", message)
    message = (f"Rate limit reached for {what} (scope '{result.scope}'). Please try again "
               f"in {_duration(result.retry_after)}.")
    return ErrorInfo(429, "rate_limit_error", f"rate_limit_{result.limit}", message,
                     True, max(result.retry_after, 0.001))


class QuotaAdmission:
    """Token quotas and money budgets, reserved together in one script.

    ``budgets`` and ``prices`` (both kept in sync with their KV buckets) are
    optional: without them only the policies apply. ``clock`` is the time
    used for windows and calendar periods (tests pass a fake one)."""

    def __init__(self, store: Quotas, policies: PolicySet,
                 models: Mapping[str, ModelConfig], fail_open: bool,
                 budgets: BudgetSet | None = None, prices: PriceBook | None = None,
                 spend: SpendConfig | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.policies = policies
        self.models = models
        self.fail_open = fail_open
        self.budgets = budgets
        self.prices = prices
        self.spend = spend or SpendConfig()
        self.tz = zoneinfo.ZoneInfo(self.spend.timezone)
        self.clock = clock
        self._last_outage_log = 0.0
        # Request ids whose reserve failed: maybe charged, surely not to be
        # reconciled by anyone else. Bounded: past it, the lease expiry frees them.
        self._doubtful: dict[str, tuple[int, float]] = {}  # id -> (undos done, next at)
        self._undoing: asyncio.Task[None] | None = None

    async def admit(self, request: Request) -> Decision:
        applicable = self.policies.applicable(request.tenant, request.model, request.user,
                                              batch=request.klass == "batch")
        budgets = (self.budgets.applicable(request.tenant, request.model, request.user,
                                           request.key_id) if self.budgets else [])
        if not applicable and not budgets:
            return ADMIT
        scopes = [Scope(p.scope_id, Limits(rpm=p.rpm, tpm=p.tpm, concurrency=p.concurrency))
                  for p in applicable]
        model = self.models.get(request.model)
        cap = model.reserve_max_tokens if model is not None else 1024
        tokens = reservation(request.api, request.body, cap)
        now = self.clock()
        charges, money = self._charges(request, budgets, tokens, now)
        try:
            result = await self.store.reserve(request.id, scopes, tokens, now=now,
                                               budgets=charges, money=money)
            headers = rate_limit_headers(result, anthropic=apis.of(request.api).anthropic)
            if result.admitted and budgets and money:
                self._alert(budgets, result.budget_spent, money)
        except QuotaUnavailable as exc:
            return self._outage(request, exc)
        except Exception:
            # The script may have charged before the failure (its reply, the
            # headers, an alert): the caller answers an error and never
            # dispatches, so nothing would ever reconcile this reservation.
            await self.refund(request.id)
            raise
        if result.admitted:
            return Decision(Admission.ADMITTED, headers=headers, reserved=True)
        log.info("request %s rejected: %s limit of %s", request.id, result.limit, result.scope)
        tm.get().metrics.quota_rejections.add(1, {tm.LIMIT: result.limit,
                                                  tm.MODEL: request.model})
        if result.limit == "budget":
            failed = next((b for b in budgets if b.budget_id == result.scope), None)
            error = _budget_rejection(result, failed, money, self.spend.currency)
        else:
            error = _rejection(result, tokens)
        return Decision(Admission.REJECTED, error=error, headers=headers)

    def _charges(self, request: Request, budgets: list[Budget], tokens: int,
                 now: float) -> tuple[list[BudgetCharge], int]:
        """The budgets' charges and the money reserved: the prompt estimate
        at the input price plus the completion cap at the output price (the
        most the request can cost, as far as can be told before it runs),
        plus the per-request price. No price: nothing to reserve (0)."""
        if not budgets:
            return [], 0
        price = self.prices.get(request.model) if self.prices is not None else None
        money = 0
        if price is not None:
            prompt = min(estimate_prompt_tokens(request.api, request.body), tokens)
            money = price.cost(prompt, tokens - prompt)
        charges = []
        for budget in budgets:
            period = period_window(budget, now, self.tz)
            charges.append(BudgetCharge(budget.budget_id, budget.nanos, period.label,
                                        budget.window, period.reset_in, period.ttl,
                                        budget.soft))
        return charges, money

    def _alert(self, budgets: list[Budget], spent: tuple[int, ...], money: int) -> None:
        """A metric and a log line for every alert threshold this reservation
        crossed (soft budgets only alert; hard ones alert before refusing)."""
        for budget, after in zip(budgets, spent, strict=False):
            limit = budget.nanos
            before = after - money
            for ratio in self.spend.alert_at:
                mark = limit * ratio
                if before < mark <= after:
                    log.warning("budget alert: %s reached %d%% (%s of %s %s%s)", budget.label,
                                round(ratio * 100), format_money(after), format_money(limit),
                                self.spend.currency, ", soft: not enforced" if budget.soft
                                else "")
                    tm.get().metrics.budget_alerts.add(1, {tm.BUDGET: budget.budget_id,
                                                           tm.THRESHOLD: str(ratio)})

    async def refund(self, request_id: str) -> None:
        """Reconcile the reservation to zero now, or, while Redis is out, as
        soon as it answers (the doubtful reservations' undo)."""
        try:
            await self.store.reconcile(request_id, 0)
        except QuotaUnavailable as exc:
            log.warning("cannot refund %s yet (%s); retrying when the store answers",
                        request_id, exc)
            self._doubt(request_id)

    def _doubt(self, request_id: str) -> None:
        """Undo ``request_id``'s reservation once Redis answers (:meth:`_undo`)."""
        if len(self._doubtful) < MAX_DOUBTFUL:
            self._doubtful[request_id] = (0, 0.0)
            if self._undoing is None or self._undoing.done():
                self._undoing = asyncio.get_running_loop().create_task(self._undo())

    def _outage(self, request: Request, exc: QuotaUnavailable) -> Decision:
        self._doubt(request.id)
        now = time.monotonic()
        if now - self._last_outage_log > 5.0:  # loud, but not one line per request
            self._last_outage_log = now
            log.error("quota store unavailable (%s): failing %s", exc,
                      "open (admitting without quotas)" if self.fail_open else
                      "closed (rejecting with 503)")
        if self.fail_open:
            return ADMIT
        tm.get().metrics.quota_rejections.add(1, {tm.LIMIT: "store_unavailable",
                                                  tm.MODEL: request.model})
        return Decision(Admission.REJECTED, error=ErrorInfo(
            503, "service_unavailable", "quota_store_unavailable",
            "Rate limits cannot be checked right now (quota store unavailable); retry shortly.",
            True, 2.0))

    async def _undo(self) -> None:
        """Reconcile every doubtful reservation to zero once Redis answers,
        then again at each of :data:`REDO` s after: a reserve sent over a cut
        link can arrive after the heal (the kernel retransmits what an
        abandoned connection still had queued) and charge anew. Reconciling one
        that never ran does nothing; so does a second call."""
        delay = 0.5
        while self._doubtful:
            now = time.monotonic()
            due = [rid for rid, (_, at) in self._doubtful.items() if at <= now]
            for request_id in due:
                try:
                    await self.store.reconcile(request_id, 0)
                except QuotaUnavailable:
                    delay = min(delay * 2, 5.0)
                    break
                delay = 0.5
                stage = self._doubtful[request_id][0]
                if stage >= len(REDO):
                    del self._doubtful[request_id]
                else:
                    self._doubtful[request_id] = (stage + 1, time.monotonic() + REDO[stage])
            await asyncio.sleep(delay)


MAX_DOUBTFUL = 100_000  # doubtful reservations kept for undoing (ids, ~100 bytes each)
REDO = (5.0, 15.0, 45.0, 120.0)  # seconds after an undo, undone again (see _undo)
