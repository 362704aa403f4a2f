"""Admission policy: the seam where quotas and queue mode plug in.

The dispatcher loop asks an :class:`AdmissionPolicy` about every request and
acts on the :class:`Decision`; it never decides anything itself.

* :class:`AdmitAll` admits everything (no policies configured).
* :class:`QuotaAdmission` reserves the request's estimated tokens in every
  applicable policy scope with one Redis round trip (``dispatcher.quota``),
  and answers 429 with OpenAI's rate-limit headers when a limit is hit. When
  Redis is unavailable it fails closed (503) or open (admit, loudly), as
  ``dispatcher.quota_failure`` says.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from dispatcher.quota import Limits, QuotaResult, Quotas, QuotaUnavailable, Scope
from tidegate.config import ModelConfig
from tidegate.control.policies import PolicySet
from tidegate.telemetry import telemetry as tm
from tidegate.wire.protocol import Admission, ErrorInfo, Request
from tidegate.wire.tokens import reservation

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


class AdmitAll:
    """Admits every request."""

    async def admit(self, request: Request) -> Decision:
        return ADMIT


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


def rate_limit_headers(result: QuotaResult) -> dict[str, str]:
    headers: dict[str, str] = {}
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
    def __init__(self, store: Quotas, policies: PolicySet,
                 models: Mapping[str, ModelConfig], fail_open: bool) -> None:
        self.store = store
        self.policies = policies
        self.models = models
        self.fail_open = fail_open
        self._last_outage_log = 0.0

    async def admit(self, request: Request) -> Decision:
        applicable = self.policies.applicable(request.tenant, request.model, request.user,
                                              batch=request.klass == "batch")
        if not applicable:
            return ADMIT
        scopes = [Scope(p.scope_id, Limits(rpm=p.rpm, tpm=p.tpm, concurrency=p.concurrency))
                  for p in applicable]
        model = self.models.get(request.model)
        cap = model.reserve_max_tokens if model is not None else 1024
        tokens = reservation(request.api, request.body, cap)
        try:
            result = await self.store.reserve(request.id, scopes, tokens)
        except QuotaUnavailable as exc:
            return self._outage(request, exc)
        headers = rate_limit_headers(result)
        if result.admitted:
            return Decision(Admission.ADMITTED, headers=headers, reserved=True)
        log.info("request %s rejected: %s limit of %s", request.id, result.limit, result.scope)
        tm.get().metrics.quota_rejections.add(1, {tm.LIMIT: result.limit,
                                                  tm.MODEL: request.model})
        return Decision(Admission.REJECTED, error=_rejection(result, tokens), headers=headers)

    def _outage(self, request: Request, exc: QuotaUnavailable) -> Decision:
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
