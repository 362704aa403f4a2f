"""Quota enforcement in Redis: one Lua script, one round trip per admission.

:meth:`QuotaStore.reserve` charges a request against every :class:`Scope`
whose policy applies, atomically: every scope has room and is charged, or
nothing is written. Rates use an exact sliding window per scope (a zset of
request ids, a hash of amounts, a running total), concurrency a zset of leases
that expire on their own; a record per request lets :meth:`QuotaStore.reconcile`
and :meth:`QuotaStore.release` work from the id alone, idempotently. A request
already charged (redelivered) is admitted without a second charge.

Invariants: ``now`` comes from the caller (dispatchers must agree on time);
every key carries one hash tag, so every script touches one Redis Cluster slot
and declares its keys; an unreachable Redis raises :class:`QuotaUnavailable`
within ``timeout``. Docs: docs/quotas.md#how-a-limit-is-enforced.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from dispatcher.quota_scripts import RECONCILE as _RECONCILE
from dispatcher.quota_scripts import RELEASE as _RELEASE
from dispatcher.quota_scripts import RESERVE as _RESERVE
from dispatcher.redis_client import TRANSPORT_RACE, RedisClient, connect_cluster, is_cluster_url
from tidegate.errors import TidegateError

__all__ = [
    "BudgetCharge",
    "Limits",
    "QuotaResult",
    "QuotaStore",
    "QuotaUnavailable",
    "Quotas",
    "Scope",
    "connect",
]

LimitKind = Literal["", "requests", "tokens", "concurrency", "budget"]

# Keys outlive their data by this much (seconds of Redis time). Scores use the
# caller's clock; the margin absorbs clock skew between dispatchers and Redis.
_TTL_MARGIN = 60.0

# A refused concurrency slot frees when some stream ends, which nobody can
# predict; clients are told to try again after this many seconds.
_CONCURRENCY_RETRY = 1.0


class QuotaUnavailable(TidegateError):
    """Redis could not be reached or did not answer in time."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-scope limits; 0 means unlimited."""

    rpm: int = 0  # requests per window
    tpm: int = 0  # tokens per window
    concurrency: int = 0  # requests holding a slot at once


@dataclass(frozen=True, slots=True)
class Scope:
    """One policy a request is charged against. ``id`` names the policy stably
    (e.g. ``tenant.acme.model.=.user.=``): it is part of the Redis keys."""

    id: str
    limits: Limits


@dataclass(frozen=True, slots=True)
class BudgetCharge:
    """One budget a request is charged against, in nano-units of money.

    ``id`` names the budget (its KV key); ``period`` the calendar period it
    is in ("" for rolling), which is part of its Redis keys, so a new period
    starts from zero without anyone resetting anything. ``window`` > 0 makes it
    a rolling window of that many seconds; ``reset_in`` is the seconds to the
    calendar period's end (the Retry-After of a refusal); ``ttl`` how long its
    keys live."""

    id: str
    limit: int
    period: str = ""
    window: float = 0.0
    reset_in: float = 0.0
    ttl: float = 86400.0
    soft: bool = False


@dataclass(frozen=True, slots=True)
class QuotaResult:
    """The outcome of :meth:`QuotaStore.reserve`.

    When refused, ``limit`` and ``scope`` name the limit that refused (the one
    that frees last when several do) and ``retry_after`` is when the request
    would fit, all else unchanged. ``too_large`` means the reservation exceeds
    a token limit by itself: it can never pass.

    The ``*_requests`` / ``*_tokens`` fields are OpenAI's rate-limit header
    values for the most constraining scope (least remaining) of each kind, or
    0 when no scope limits that kind. ``reset_*`` is the time (seconds) until
    that scope's window is back to its initial state, i.e. holds none of its
    current entries.
    """

    admitted: bool
    limit: LimitKind = ""
    scope: str = ""
    retry_after: float = 0.0
    too_large: bool = False
    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests: float = 0.0
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens: float = 0.0
    # The least left of the hard budgets after this call (nano-units), -1 when
    # none applies; and every budget's spend after it, in the order given.
    remaining_budget: int = -1
    budget_spent: tuple[int, ...] = ()


class Quotas(Protocol):
    """The seam the admission policy depends on (a fake implements it in tests)."""

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int,
                      now: float | None = None, budgets: Sequence[BudgetCharge] = (),
                      money: int = 0) -> QuotaResult: ...

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None, actual_money: int = 0) -> None: ...

    async def release(self, request_id: str) -> None: ...


def connect(url: str, timeout: float) -> RedisClient:
    """A client suited to the store: replies as text, every socket operation
    bounded by ``timeout``, and one immediate retry (a pooled connection broken
    by a Redis restart fails once, its replacement then connects) instead of
    redis-py's default backoff, which would delay reporting an outage by
    seconds. A cluster URL (:mod:`dispatcher.redis_client`) gets a cluster client."""
    if is_cluster_url(url):
        return connect_cluster(url, timeout)
    return aioredis.Redis.from_url(
        url, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1), decode_responses=True)


_UNAVAILABLE = (
    rexc.ConnectionError,  # includes BusyLoadingError
    rexc.TimeoutError,
    rexc.ReadOnlyError,  # a replica promoted or demoted under us
    rexc.ClusterDownError,
    rexc.MasterDownError,
    rexc.SlotNotCoveredError,  # Redis Cluster: the slot's primary is down
    rexc.TryAgainError,
    OSError,
    TimeoutError,
)


class QuotaStore:
    """Quota state in Redis. Safe to share between tasks and between any number
    of dispatcher processes: all decisions happen inside Redis."""

    def __init__(self, redis: RedisClient, prefix: str = "tg", window: float = 60.0,
                 lease: float = 1800.0) -> None:
        if window <= 0 or lease <= 0:
            raise ValueError("window and lease must be > 0")
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix must be non-empty and free of braces, got {prefix!r}")
        self.redis = redis
        self.window = window
        self.lease = lease
        self._base = f"{prefix}:{{{prefix}q}}"
        self._reserve = redis.register_script(_RESERVE)
        self._reconcile = redis.register_script(_RECONCILE)
        self._release = redis.register_script(_RELEASE)
        self._window_ttl_ms = _ms(window + _TTL_MARGIN)
        self._lease_ttl_ms = _ms(lease + _TTL_MARGIN)
        self._record_ttl_ms = _ms(max(window, lease) + _TTL_MARGIN)

    @property
    def scripts(self) -> tuple[Any, ...]:
        """The registered Lua scripts (preloaded by
        :func:`dispatcher.redis_client.preload_scripts`)."""
        return (self._reserve, self._reconcile, self._release)

    @property
    def key_prefix(self) -> str:
        """Every key of this store starts with it, hash tag included."""
        return self._base + ":"

    def record_key(self, request_id: str) -> str:
        return f"{self._base}:r:{request_id}"

    def scope_keys(self, scope_id: str) -> list[str]:
        """The window (w, a, t) and lease (c) keys of one scope."""
        return [f"{self._base}:{kind}:{scope_id}" for kind in ("w", "a", "t", "c")]

    def budget_base(self, budget: BudgetCharge) -> str:
        """The common start of a budget's keys (``:w``, ``:a``, ``:t``), for
        its current calendar period or its rolling window."""
        return f"{self._base}:b:{budget.id}:{budget.period or 'r'}"

    async def reserve(self, request_id: str, scopes: Sequence[Scope], tokens: int,
                      now: float | None = None, budgets: Sequence[BudgetCharge] = (),
                      money: int = 0) -> QuotaResult:
        """Charge ``tokens`` and one request to every scope, and ``money``
        (nano-units) to every budget, or to none.

        Scopes without limits are skipped. Reserving an id that is already
        charged admits it again without a second charge."""
        if not request_id:
            raise ValueError("request_id must not be empty")
        if tokens < 0 or money < 0:
            raise ValueError(f"tokens and money must be >= 0, got {tokens}, {money}")
        scopes = [s for s in scopes if s.limits.rpm or s.limits.tpm or s.limits.concurrency]
        ids = [s.id for s in scopes] + [b.id for b in budgets]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate scope or budget ids in {ids}")
        if not ids:
            return QuotaResult(admitted=True)
        now = time.time() if now is None else now
        bases = [self.budget_base(b) for b in budgets]
        keys = [self.record_key(request_id)]
        args: list[Any] = [repr(now), repr(self.window), repr(self.lease), request_id, tokens,
                           self._window_ttl_ms, self._lease_ttl_ms, self._record_ttl_ms,
                           json.dumps(ids[:len(scopes)]), repr(_CONCURRENCY_RETRY),
                           len(scopes), money, json.dumps(bases),
                           "".join("r" if b.window > 0 else "c" for b in budgets)]
        for scope in scopes:
            keys.extend(self.scope_keys(scope.id))
            args.extend((scope.limits.rpm, scope.limits.tpm, scope.limits.concurrency))
        budget_args: list[Any] = []
        for budget, base in zip(budgets, bases, strict=True):
            keys.extend((f"{base}:w", f"{base}:a", f"{base}:t"))
            budget_args.extend((budget.limit, repr(budget.window),
                                _ms(max(budget.ttl, budget.window) + _TTL_MARGIN),
                                repr(budget.reset_in), int(budget.soft)))
        reply = await self._call(self._reserve, keys, args + budget_args)
        (admitted, kind, failed, retry, too_large,
         lim_r, rem_r, reset_r, lim_t, rem_t, reset_t, rem_b, spent) = reply
        return QuotaResult(
            admitted=bool(admitted), limit=cast(LimitKind, _text(kind)),
            scope=ids[int(failed) - 1] if int(failed) else "",
            retry_after=float(retry), too_large=bool(too_large),
            limit_requests=int(lim_r), remaining_requests=int(rem_r),
            reset_requests=float(reset_r), limit_tokens=int(lim_t),
            remaining_tokens=int(rem_t), reset_tokens=float(reset_t),
            remaining_budget=int(rem_b), budget_spent=tuple(int(v) for v in spent))

    async def reconcile(self, request_id: str, actual_tokens: int,
                        now: float | None = None, actual_money: int = 0) -> None:
        """Replace the reserved amount by ``actual_tokens`` in every scope the
        request was charged to (while its entry is still in the window), its
        reserved money by ``actual_money`` in every budget (in the period it
        was reserved in), and free its concurrency slot. A second call does
        nothing.

        ``now`` is accepted for symmetry with :meth:`reserve`: the adjustment
        applies to the entry at its original time, so the clock is not needed.
        """
        del now
        if actual_tokens < 0 or actual_money < 0:
            raise ValueError(f"actual tokens and money must be >= 0, got {actual_tokens}, "
                             f"{actual_money}")
        found = await self._keys_of(request_id)
        if found is not None:
            keys, n = found
            await self._call(self._reconcile, keys, [request_id, actual_tokens, n,
                                                     actual_money])

    async def release(self, request_id: str) -> None:
        """Free the request's concurrency slot only (it ended without usage to
        report, e.g. its worker was lost). A second call does nothing."""
        found = await self._keys_of(request_id)
        if found is not None:
            keys, n = found
            await self._call(self._release, keys, [request_id, n])

    async def _keys_of(self, request_id: str) -> tuple[list[str], int] | None:
        """Every key the request's record names, and how many scopes it has."""
        record = self.record_key(request_id)
        raw, bases = await self._retrying(lambda: self.redis.hmget(record, "scopes",
                                                                   "budgets"))
        if raw is None:
            return None  # never reserved, already reconciled, or expired
        keys = [record]
        scopes = json.loads(raw)
        for scope_id in scopes:
            keys.extend(self.scope_keys(scope_id))
        for base in json.loads(bases) if bases else ():
            keys.extend((f"{base}:w", f"{base}:a", f"{base}:t"))
        return keys, len(scopes)

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        async def run() -> Any:
            try:
                return await script(keys=keys, args=args)
            except rexc.NoScriptError:
                # The script cache of the node holding the keys is empty (it
                # restarted) and redis-py's reload (SCRIPT LOAD on every
                # primary, on a cluster) failed, e.g. another primary is down.
                # EVAL runs it on the keys' node and caches it there.
                return await self.redis.eval(script.script, len(keys), *keys, *args)

        return await self._retrying(run)

    async def _retrying(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """``call()``, once more if a pooled connection closed under it.

        redis-py's cluster client disconnects a node's connections after one
        error, and a command caught writing on such a transport raises a
        non-Redis error (redis-py issue 4287). Every call here is idempotent
        per request id (a second reserve admits without charging again), so
        one retry on a fresh connection is safe.
        """
        try:
            try:
                return await call()
            except TRANSPORT_RACE:
                return await call()
        except _UNAVAILABLE + TRANSPORT_RACE as exc:
            raise QuotaUnavailable(_describe(exc)) from exc


def _ms(seconds: float) -> int:
    return math.ceil(seconds * 1000)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _describe(exc: BaseException) -> str:
    return f"redis: {type(exc).__name__}: {exc}" if str(exc) else f"redis: {type(exc).__name__}"
