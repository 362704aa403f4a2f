"""Budgets in money: what they are, which apply to a request, their periods, their bucket.

A :class:`Budget` caps what one scope (tenant, tenant x key, tenant x user,
tenant x model) may spend in ``spend.currency`` per period: a calendar
``day``, ``week`` or ``month`` in ``spend.timezone``, or a ``rolling`` window.
A *soft* budget only alerts (at the fractions ``spend.alert_at``).

Budgets live in ``<P>_BUDGETS`` keyed by :attr:`Budget.budget_id`, so a scope
has at most one budget per period kind. Dispatchers enforce them in the same
Redis script as the token quotas (``dispatcher.quota``); :class:`BudgetSet` is
their sans-I/O index. Docs: docs/spend.md.
"""

from __future__ import annotations

import json
import logging
import zoneinfo
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from decimal import Decimal
from typing import Any, Literal, cast

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker.broker import ensure_bucket
from tidegate.broker.kvwatch import follow_bucket, snapshot
from tidegate.config import Config
from tidegate.control.policies import decode_record
from tidegate.control.prices import format_money, parse_amount, to_nanos
from tidegate.errors import ProtocolError
from tidegate.wire.subjects import encode_token

log = logging.getLogger("tidegate.budgets")

Period = Literal["day", "week", "month", "rolling"]
PERIODS: tuple[Period, ...] = ("day", "week", "month", "rolling")
ANY = "="
# A rolling window's bounds: at least a minute, at most a year (its entries
# are kept in Redis for the window, one per request).
MIN_WINDOW, MAX_WINDOW = 60.0, 366 * 86400.0
MAX_AMOUNT = Decimal(1_000_000_000)  # 10^18 nano-units: below Redis's 2^63, not 2^53
_FIELDS = ("tenant", "model", "user", "key", "amount", "period", "window", "soft")


def bucket_name(config: Config) -> str:
    return f"{config.nats.subjects.prefix.upper()}_BUDGETS"


@dataclass(frozen=True, slots=True)
class Budget:
    """A cap on one scope's spend per period. ``""`` = any."""

    tenant: str
    amount: Decimal
    period: Period = "month"
    model: str = ""
    user: str = ""
    key: str = ""
    window: float = 0.0  # seconds; rolling budgets only
    soft: bool = False  # alert only, never refuse

    def __post_init__(self) -> None:
        for name in ("tenant", "model", "user", "key"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"budget {name} must be a string")
        if not self.tenant:
            raise ValueError("a budget needs its tenant")
        if sum(1 for v in (self.model, self.user, self.key) if v) > 1:
            raise ValueError("a budget's scope is the tenant, or the tenant with one of "
                             "--model, --user, --key")
        amount = parse_amount(self.amount, "amount")
        if amount > MAX_AMOUNT:
            raise ValueError(f"amount must be at most {MAX_AMOUNT}, got {self.amount!r}")
        object.__setattr__(self, "amount", amount)
        if self.period not in PERIODS:
            raise ValueError(f"period must be one of {', '.join(PERIODS)}, got {self.period!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int | float):
            raise ValueError(f"window must be seconds, got {self.window!r}")
        if self.period == "rolling":
            if not MIN_WINDOW <= self.window <= MAX_WINDOW:
                raise ValueError(f"a rolling budget's window must be between "
                                 f"{MIN_WINDOW:g}s and {MAX_WINDOW:g}s, got {self.window!r}")
        elif self.window:
            raise ValueError("window is for rolling budgets only")
        if not isinstance(self.soft, bool):
            raise ValueError(f"soft must be true or false, got {self.soft!r}")

    @property
    def scope(self) -> tuple[str, str, str, str]:
        return self.tenant, self.model, self.user, self.key

    @property
    def budget_id(self) -> str:
        return budget_id(self.tenant, self.model, self.user, self.key, self.period)

    @property
    def nanos(self) -> int:
        return to_nanos(self.amount)

    @property
    def label(self) -> str:
        """Human-readable, e.g. ``tenant 'acme' x model 'gpt-4o', per month``."""
        scope = " x ".join(f"{n} {v!r}" for n, v in (("tenant", self.tenant),
                                                      ("model", self.model),
                                                      ("user", self.user), ("key", self.key))
                           if v)
        per = f"rolling {self.window:g}s" if self.period == "rolling" else f"per {self.period}"
        return f"{scope}, {per}"

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.tenant, "model": self.model, "user": self.user,
                "key": self.key, "amount": format_money(self.nanos), "period": self.period,
                "window": self.window, "soft": self.soft}

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Budget:
        return decode_record(cls, data, _FIELDS, "budget")


def budget_id(tenant: str, model: str = "", user: str = "", key: str = "",
              period: str = "month") -> str:
    """The KV key (and Redis key part) of a budget."""
    tokens = [encode_token(v) if v else ANY for v in (tenant, model, user, key)]
    return (f"tenant.{tokens[0]}.model.{tokens[1]}.user.{tokens[2]}.key.{tokens[3]}"
            f".per.{period}")


class BudgetSet:
    """The budgets in force, indexed by scope (sans-I/O): :meth:`applicable`
    looks up the at most 4 scopes a request falls in, whatever their number."""

    def __init__(self) -> None:
        self._by_scope: dict[tuple[str, str, str, str], dict[str, Budget]] = {}
        self._by_id: dict[str, Budget] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __iter__(self) -> Iterator[Budget]:
        return iter(sorted(self._by_id.values(), key=lambda b: (b.scope, b.period)))

    def put(self, budget: Budget) -> None:
        self.remove(budget.budget_id)
        self._by_id[budget.budget_id] = budget
        self._by_scope.setdefault(budget.scope, {})[budget.period] = budget

    def remove(self, bid: str) -> Budget | None:
        budget = self._by_id.pop(bid, None)
        if budget is not None:
            periods = self._by_scope.get(budget.scope, {})
            periods.pop(budget.period, None)
            if not periods:
                self._by_scope.pop(budget.scope, None)
        return budget

    def applicable(self, tenant: str, model: str, user: str = "",
                   key: str = "") -> list[Budget]:
        found: list[Budget] = []
        scopes = [(tenant, "", "", ""), (tenant, model, "", "")]
        if user:
            scopes.append((tenant, "", user, ""))
        if key:
            scopes.append((tenant, "", "", key))
        for scope in scopes:
            found.extend(self._by_scope.get(scope, {}).values())
        return found

    def apply(self, bid: str, value: bytes) -> None:
        try:
            budget = Budget.decode(value)
            if budget.budget_id != bid:
                raise ProtocolError(f"budget {budget.budget_id} stored under {bid}")
        except ProtocolError as exc:
            log.error("ignoring budget %s: %s", bid, exc)
            return
        self.put(budget)


# --------------------------------------------------------------------------
# Periods (pure: the caller passes the clock)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PeriodWindow:
    """Where ``now`` falls for one budget: ``label`` names the calendar
    period in Redis keys ("" for rolling), ``reset_in`` is the seconds to its
    end (for rolling, the window, an upper bound), ``ttl`` how long its keys live."""

    label: str
    reset_in: float
    ttl: float


def _midnight(day: date, tz: zoneinfo.ZoneInfo) -> float:
    return datetime(day.year, day.month, day.day, tzinfo=tz).timestamp()


def period_window(budget: Budget, now: float, tz: zoneinfo.ZoneInfo) -> PeriodWindow:
    """The calendar period of ``budget`` at ``now`` (seconds since the epoch)
    in the time zone ``tz``. Days start at local midnight (a DST day lasts 23
    or 25 hours), weeks on Monday, months on the 1st."""
    if budget.period == "rolling":
        return PeriodWindow("", budget.window, budget.window)
    today = datetime.fromtimestamp(now, tz).date()
    if budget.period == "day":
        start, end = today, today + timedelta(days=1)
        label = f"d{start.isoformat()}"
    elif budget.period == "week":
        start = today - timedelta(days=today.weekday())
        end = start + timedelta(days=7)
        label = f"w{start.isoformat()}"
    else:
        start = today.replace(day=1)
        end = (start + timedelta(days=32)).replace(day=1)
        label = f"m{start.year:04d}-{start.month:02d}"
    reset_in = max(_midnight(end, tz) - now, 0.0)
    # Kept a day past the period: late reconciles still find the total.
    return PeriodWindow(label, reset_in, reset_in + 86400.0)


def timezone(config: Config) -> zoneinfo.ZoneInfo:
    return zoneinfo.ZoneInfo(config.spend.timezone)


# --------------------------------------------------------------------------
# KV
# --------------------------------------------------------------------------


async def ensure_budgets_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await ensure_bucket(js, config, bucket_name(config), "tidegate: budgets in money")


async def watch_budgets(kv: KeyValue, budgets: BudgetSet, *,
                        on_synced: Callable[[], None] | None = None) -> None:
    """Keep ``budgets`` equal to the bucket. Runs until cancelled."""
    def delete(bid: str) -> None:
        budgets.remove(bid)

    await follow_bucket(kv, budgets.apply, delete, on_synced=on_synced)


async def set_budget(kv: KeyValue, budget: Budget) -> None:
    await kv.put(budget.budget_id, budget.encode())


async def delete_budget(kv: KeyValue, bid: str) -> bool:
    try:
        await kv.get(bid)
    except nats.js.errors.KeyNotFoundError:
        return False
    await kv.delete(bid)
    return True


async def list_budgets(kv: KeyValue) -> list[Budget]:
    out = BudgetSet()
    for bid, value in (await snapshot(kv)).items():
        out.apply(bid, value)
    return list(out)


def parse_period(value: str) -> tuple[Period, float]:
    """``day``, ``week``, ``month`` or ``rolling:<duration>`` -> (period, window)."""
    from tidegate.control.admin import UsageError, parse_duration

    text = value.strip().lower()
    if text in ("day", "week", "month"):
        return cast(Period, text), 0.0
    if text.startswith("rolling:"):
        try:
            return "rolling", parse_duration(text[len("rolling:"):])
        except UsageError as exc:
            raise ValueError(str(exc)) from None
    raise ValueError(f"expected day, week, month or rolling:<duration> (e.g. rolling:24h), "
                     f"got {value!r}")

