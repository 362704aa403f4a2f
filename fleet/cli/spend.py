"""``tidegate price``, ``tidegate budget`` and ``tidegate usage`` (docs/spend.md).

``price`` and ``budget`` edit the KV buckets ``<P>_PRICES`` and ``<P>_BUDGETS``
that workers and dispatchers watch. ``usage`` reads the usage log
(``<P>_USAGE``) from ``--since`` on through an ephemeral consumer, a batch of
records at a time, and sums them per group: memory grows with the number of
groups (tenants, keys, models or days), never with the number of records, so
a month of records streams through in constant space.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
import zoneinfo
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

from fleet.cli.admin import checked_name  # one rule for every name flag
from fleet.cli.common import add_common, load_config
from tidegate.config import Config

BY = ("tenant", "key", "model", "day", "user")
_BATCH = 512  # records fetched at once: the report's whole working set
_MAX_GROUPS = 1_000_000  # a bound on memory even for a hostile --by key over a huge log


def _amount(value: str) -> Any:
    from tidegate.control.prices import parse_amount

    try:
        return parse_amount(value, "amount")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None




def spend_parsers(sub: Any) -> None:
    price = sub.add_parser("price", help="set, list and delete prices per model",
                           description="Prices live in the NATS KV bucket TG_PRICES, over "
                                       "the config's models[].price_*; workers and "
                                       "dispatchers apply a change within a second. Amounts "
                                       "are in spend.currency. See docs/spend.md.")
    price_sub = price.add_subparsers(dest="price_command", metavar="ACTION", required=True)
    pset = price_sub.add_parser("set", help="set a model's price (replacing it)")
    add_common(pset)
    pset.add_argument("model", metavar="MODEL", type=checked_name,
                      help="the model the prices are for")
    pset.add_argument("--input", type=_amount, default="0", metavar="AMOUNT",
                      help="per million input tokens")
    pset.add_argument("--cached-input", type=_amount, metavar="AMOUNT",
                      help="per million cached input tokens (default: the input price)")
    pset.add_argument("--output", type=_amount, default="0", metavar="AMOUNT",
                      help="per million output tokens")
    pset.add_argument("--request", type=_amount, default="0", metavar="AMOUNT",
                      help="per request")
    pdel = price_sub.add_parser("delete", help="delete a model's stored price (the "
                                               "config's applies again)")
    add_common(pdel)
    pdel.add_argument("model", metavar="MODEL", type=checked_name,
                      help="the model whose prices to delete")
    plist = price_sub.add_parser("list", help="list stored prices")
    add_common(plist)
    plist.add_argument("--json", action="store_true", help="print JSON")

    budget = sub.add_parser("budget", help="set, list and delete budgets in money",
                            description="Budgets live in the NATS KV bucket TG_BUDGETS; "
                                        "dispatchers enforce them with the token quotas. "
                                        "See docs/spend.md.")
    budget_sub = budget.add_subparsers(dest="budget_command", metavar="ACTION", required=True)
    bset = budget_sub.add_parser(
        "set", help="set a budget (replacing the one of its scope and period)",
        description="Scope: --tenant, alone or with one of --model, --user, --key.")
    bdel = budget_sub.add_parser("delete", help="delete a budget")
    for p in (bset, bdel):
        add_common(p)
        p.add_argument("--tenant", type=checked_name, required=True, help="tenant")
        p.add_argument("--model", type=checked_name, help="only this model's spend")
        p.add_argument("--user", type=checked_name, help="only this user's spend")
        p.add_argument("--key", type=checked_name, metavar="KEY_ID", help="only this key's spend")
        p.add_argument("--per", default="month", metavar="PERIOD",
                       help="day, week, month (calendar, spend.timezone) or "
                            "rolling:<duration>, e.g. rolling:24h (default: month)")
    bset.add_argument("--amount", type=_amount, required=True, help="the cap, in "
                                                                     "spend.currency")
    bset.add_argument("--soft", action="store_true", help="alert only, never refuse")
    blist = budget_sub.add_parser("list", help="list budgets")
    add_common(blist)
    blist.add_argument("--json", action="store_true", help="print JSON")

    usage = sub.add_parser("usage", help="sum the usage log by tenant, key, model or day",
                           description="Reads the usage stream TG_USAGE (kept for "
                                       "streams.usage_max_age) from --since on, in constant "
                                       "memory. See docs/spend.md.")
    add_common(usage)
    usage.add_argument("--by", choices=BY, default="tenant", help="group by (default: tenant)")
    usage.add_argument("--since", default="24h", metavar="WHEN",
                       help="a duration back from now (24h, 7d) or a date/time "
                            "(2026-12-01, 2026-12-01T08:00:00+00:00); default 24h")
    usage.add_argument("--tenant", type=checked_name, help="only this tenant's records")
    out = usage.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print JSON")
    out.add_argument("--csv", action="store_true", help="print CSV")


# --------------------------------------------------------------------------
# price, budget
# --------------------------------------------------------------------------


def cmd_price(args: argparse.Namespace) -> int:
    from nats.js import JetStreamContext

    from tidegate.control import admin
    from tidegate.control import prices as tgprices

    config = load_config(args)
    if args.price_command == "set":
        try:
            price = tgprices.Price(admin.canonical_model(config, args.model), args.input,
                                   args.cached_input, args.output, args.request)
        except ValueError as exc:
            raise admin.UsageError(f"price set: {exc}") from None

        async def put(js: JetStreamContext) -> None:
            await tgprices.set_price(await tgprices.ensure_prices_bucket(js, config), price)

        admin.run(config, put)
        print(f"set price of {price.model}: {_price_text(price, config.spend.currency)}")
        return 0
    if args.price_command == "delete":
        model = admin.canonical_model(config, args.model)

        async def delete(js: JetStreamContext) -> bool:
            return await tgprices.delete_price(await tgprices.ensure_prices_bucket(js, config),
                                               model)

        if not admin.run(config, delete):
            raise admin.NotFound(f"no stored price for {model} (see `tidegate price list`)")
        print(f"deleted the stored price of {model}")
        return 0

    async def listing(js: JetStreamContext) -> list[tgprices.Price]:
        return await tgprices.list_prices(await tgprices.ensure_prices_bucket(js, config))

    stored = admin.run(config, listing)
    if args.json:
        print(json.dumps([{**p.as_dict(), "currency": config.spend.currency} for p in stored]))
        return 0
    if not stored:
        print(f"no prices in {tgprices.bucket_name(config)}")
        return 0
    admin.print_table(["MODEL", "INPUT/M", "CACHED/M", "OUTPUT/M", "REQUEST"],
                 [[p.model, p.input, p.cached, p.output, p.request] for p in stored])
    return 0


def _price_text(price: Any, currency: str) -> str:
    return (f"{price.input} input, {price.cached} cached input, {price.output} output per "
            f"million tokens, {price.request} per request ({currency})")


def cmd_budget(args: argparse.Namespace) -> int:
    from nats.js import JetStreamContext

    from tidegate.control import admin
    from tidegate.control import budgets as tgbudgets

    config = load_config(args)
    if args.budget_command == "list":
        async def listing(js: JetStreamContext) -> list[tgbudgets.Budget]:
            return await tgbudgets.list_budgets(
                await tgbudgets.ensure_budgets_bucket(js, config))

        found = admin.run(config, listing)
        if args.json:
            print(json.dumps([{**b.as_dict(), "currency": config.spend.currency}
                              for b in found]))
            return 0
        if not found:
            print(f"no budgets in {tgbudgets.bucket_name(config)}")
            return 0
        admin.print_table(["TENANT", "MODEL", "USER", "KEY", "AMOUNT", "PERIOD", "SOFT"],
                     [[b.tenant, b.model or "*", b.user or "*", b.key or "*",
                       f"{b.as_dict()['amount']} {config.spend.currency}",
                       f"rolling {b.window:g}s" if b.period == "rolling" else b.period,
                       "yes" if b.soft else "no"] for b in found])
        return 0
    try:
        period, window = tgbudgets.parse_period(args.per)
        budget = tgbudgets.Budget(
            args.tenant, getattr(args, "amount", Decimal(0)), period,
            model=admin.canonical_model(config, args.model) if args.model else "",
            user=args.user or "", key=args.key or "", window=window,
            soft=bool(getattr(args, "soft", False)))
    except ValueError as exc:
        raise admin.UsageError(f"budget {args.budget_command}: {exc}") from None
    if args.budget_command == "set":
        async def put(js: JetStreamContext) -> None:
            await tgbudgets.set_budget(await tgbudgets.ensure_budgets_bucket(js, config), budget)

        admin.run(config, put)
        print(f"set budget for {budget.label}: {budget.as_dict()['amount']} "
              f"{config.spend.currency}{' (soft: alerts only)' if budget.soft else ''}")
        return 0

    async def delete(js: JetStreamContext) -> bool:
        return await tgbudgets.delete_budget(await tgbudgets.ensure_budgets_bucket(js, config),
                                             budget.budget_id)

    if not admin.run(config, delete):
        raise admin.NotFound(f"no budget for {budget.label} (see `tidegate budget list`)")
    print(f"deleted budget for {budget.label}")
    return 0


# --------------------------------------------------------------------------
# usage
# --------------------------------------------------------------------------


def parse_since(value: str, now: float) -> float:
    """``--since``: a duration back from ``now`` or an ISO date/time (UTC when
    it names no zone) -> seconds since the epoch. Raises ``ValueError``."""
    from tidegate.control.admin import UsageError, parse_duration

    text = value.strip()
    try:
        back = parse_duration(text)
    except UsageError:
        back = None
    if back is not None:
        if not 0 <= back <= 100 * 366 * 86400:
            raise ValueError(f"--since: a duration between 0 and 100 years, got {value!r}")
        return now - back
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"--since: expected a duration (24h, 7d) or a date/time "
                         f"(2026-12-01, 2026-12-01T08:00:00+00:00), got {value!r}") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


@dataclass(slots=True)
class Totals:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_nanos: int = 0


class UsageReport:
    """Sums usage records per group (sans-I/O): feed records, read rows."""

    def __init__(self, by: str, tz: zoneinfo.ZoneInfo, tenant: str = "") -> None:
        if by not in BY:
            raise ValueError(f"--by: one of {', '.join(BY)}, got {by!r}")
        self.by = by
        self.tz = tz
        self.tenant = tenant
        self.groups: dict[str, Totals] = {}
        self.records = 0
        self.skipped = 0

    def add(self, record: Any, at: float) -> None:
        """One :class:`tidegate.wire.protocol.UsageRecord`, stored at ``at``."""
        if self.tenant and record.tenant != self.tenant:
            return
        if self.by == "day":
            group = datetime.fromtimestamp(at, self.tz).date().isoformat()
        else:
            group = {"tenant": record.tenant, "key": record.key_id, "model": record.model,
                     "user": f"{record.tenant}/{record.user}"}[self.by] or "-"
        totals = self.groups.get(group)
        if totals is None:
            if len(self.groups) >= _MAX_GROUPS:
                self.skipped += 1
                return
            totals = self.groups[group] = Totals()
        self.records += 1
        totals.requests += 1
        totals.prompt_tokens += record.prompt_tokens
        totals.cached_tokens += record.cached_tokens
        totals.completion_tokens += record.completion_tokens
        totals.cost_nanos += record.cost_nanos

    def rows(self) -> Iterator[dict[str, Any]]:
        from tidegate.control.prices import format_money

        for group in sorted(self.groups):
            t = self.groups[group]
            yield {self.by: group, "requests": t.requests, "prompt_tokens": t.prompt_tokens,
                   "cached_tokens": t.cached_tokens, "completion_tokens": t.completion_tokens,
                   "cost": format_money(t.cost_nanos)}


async def read_usage(config: Config, since: float, report: UsageReport,
                     js: Any) -> None:
    """Feed ``report`` every record stored since ``since``, a batch at a time,
    through an ephemeral pull consumer (no acks; it vanishes when idle)."""
    import nats.errors
    import nats.js.errors
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from tidegate.errors import ProtocolError
    from tidegate.wire.protocol import UsageRecord

    stream = config.nats.subjects.usage_stream
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        return
    if not info.state.messages:
        return
    start = datetime.fromtimestamp(max(since, 0), UTC)
    sub = await js.pull_subscribe(
        "", stream=stream, config=ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start,
            ack_policy=AckPolicy.NONE, inactive_threshold=60.0))
    try:
        while True:
            try:
                msgs = await sub.fetch(_BATCH, timeout=2.0)
            except (nats.errors.TimeoutError, TimeoutError):
                break
            pending = 0
            for msg in msgs:
                meta = msg.metadata
                pending = meta.num_pending
                try:
                    record = UsageRecord.decode(msg.data)
                except ProtocolError:
                    report.skipped += 1
                    continue
                at = meta.timestamp.timestamp()
                if at >= since:  # the server starts at --since; this keeps the edge exact
                    report.add(record, at)
            if not msgs or pending == 0:
                break
    finally:
        await sub.unsubscribe()


def cmd_usage(args: argparse.Namespace) -> int:
    from nats.js import JetStreamContext

    from tidegate.control import admin

    config = load_config(args)
    try:
        since = parse_since(args.since, time.time())
        report = UsageReport(args.by, zoneinfo.ZoneInfo(config.spend.timezone),
                             args.tenant or "")
    except ValueError as exc:
        raise admin.UsageError(str(exc)) from None

    async def work(js: JetStreamContext) -> None:
        await read_usage(config, since, report, js)

    # Reading a month of records takes longer than one admin call: allow an hour.
    admin.run(config, work, deadline=3600.0)
    rows = list(report.rows())
    currency = config.spend.currency
    if args.json:
        print(json.dumps([{**row, "currency": currency} for row in rows]))
    elif args.csv:
        writer = csv.DictWriter(sys.stdout, fieldnames=[args.by, "requests", "prompt_tokens",
                                                        "cached_tokens", "completion_tokens",
                                                        "cost", "currency"])
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, args.by: admin.csv_safe(str(row[args.by])),
                             "currency": currency})
    elif not rows:
        print("no usage records in that range")
    else:
        admin.print_table([args.by.upper(), "REQUESTS", "PROMPT", "CACHED", "COMPLETION",
                      f"COST ({currency})"], [list(row.values()) for row in rows])
    if report.skipped:
        print(f"tidegate: note: {report.skipped} records skipped (unreadable, or past "
              f"{_MAX_GROUPS} groups)", file=sys.stderr)
    return 0

