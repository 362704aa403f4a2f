"""The connection and error contract of the operator commands (``tidegate
keys``, ``policy``, ``tenant``, ``batches``; the commands are in fleet.cli).

Each command connects once with a short timeout (unlike the tiers, which wait
for NATS forever), creates the bucket it needs when missing, does its work and
disconnects. Output is a plain table, or JSON with ``--json``. Errors follow
the CLI contract: bad input raises :class:`UsageError` (exit 2), an
unreachable NATS a :class:`~tidegate.errors.BrokerError` and a missing key or
policy :class:`NotFound` (exit 1); none prints a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from tidegate.broker.auth import connect_options
from tidegate.config import Config, NatsConfig
from tidegate.errors import BrokerError, ConfigError, TidegateError

log = logging.getLogger("tidegate.admin")

T = TypeVar("T")


class UsageError(ConfigError):
    """The command line asks for something invalid; the CLI exits 2."""


MAX_NAME = 256  # characters of a tenant or user name


def name_problem(value: object) -> str:
    """What is wrong with a tenant or user name as given (a CLI flag or a
    console field), "" when nothing: it must be non-empty and printable, so a
    listing, a log or a terminal shows what it is (a control character once
    put raw escapes into ``keys list``)."""
    if not isinstance(value, str) or not value.strip():
        return "must not be empty"
    if not value.isprintable() or len(value) > MAX_NAME:
        return f"must be printable and at most {MAX_NAME} characters, got {value[:60]!r}"
    return ""


def check_name(what: str, value: object) -> str:
    """``value``, a checked name (:func:`name_problem`); else UsageError."""
    problem = name_problem(value)
    if problem:
        raise UsageError(f"{what}: {problem}")
    assert isinstance(value, str)
    return value


def shown(cell: object) -> str:
    """A table cell as printed: control characters escaped (names stored
    before :func:`check_name`, or written by other tools, print as text)."""
    text = str(cell)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def csv_safe(cell: str) -> str:
    """A name for a CSV cell: one a spreadsheet would run as a formula
    (``=``, ``+``, ``-``, ``@``, tab or CR first) gets a leading ``'``."""
    return f"'{cell}" if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


class NotFound(TidegateError):
    """The key or policy named on the command line does not exist."""


# --------------------------------------------------------------------------
# Connecting
# --------------------------------------------------------------------------


async def connect_once(cfg: NatsConfig, name: str) -> NATS:
    """Connect to NATS or raise :class:`BrokerError` within ``cfg.connect_timeout``.

    No retries and no reconnects: a command line tool should say at once that
    NATS is not there, not wait for it the way a service does.
    """
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)  # reported in the BrokerError below, not as a logged traceback

    servers = [s.strip() for s in cfg.url.split(",") if s.strip()]
    try:
        async with asyncio.timeout(cfg.connect_timeout + 1):
            return await nats.connect(servers=servers, name=name,
                                      **connect_options(cfg, name),
                                      connect_timeout=cfg.connect_timeout,
                                      allow_reconnect=False,
                                      # nats-py reads 0 as "forever"; 1 = two tries each.
                                      max_reconnect_attempts=1, reconnect_time_wait=0.2,
                                      error_cb=on_error)
    except Exception as exc:
        cause = errors[-1] if errors else exc
        reason = (f"no answer within {cfg.connect_timeout:g}s"
                  if isinstance(cause, TimeoutError | nats.errors.TimeoutError)
                  else _describe(cause))
        raise BrokerError(f"cannot reach NATS at {cfg.url}: {reason}") from None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run(config: Config, work: Callable[[JetStreamContext], Awaitable[T]],
        deadline: float | None = None) -> T:
    """Connect, run ``work(js)`` within a deadline (default: four request
    timeouts), disconnect."""

    async def main() -> T:
        nc = await connect_once(config.nats, "tidegate-admin")
        try:
            js = nc.jetstream(timeout=config.nats.request_timeout)
            limit = deadline or config.nats.request_timeout * 4
            try:
                async with asyncio.timeout(limit):
                    return await work(js)
            except TimeoutError:
                raise BrokerError(f"NATS at {config.nats.url} did not answer within "
                                  f"{limit:.0f}s") from None
            except (nats.js.errors.ServiceUnavailableError,
                    nats.errors.NoRespondersError):
                raise BrokerError(f"JetStream is not enabled on the NATS server at "
                                  f"{config.nats.url} (start nats-server with -js)") from None
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise BrokerError(f"NATS at {config.nats.url} refused: "
                                  f"{_describe(exc)}") from None
        finally:
            try:
                await nc.close()
            except Exception as exc:  # closing a broken connection tells nothing new
                log.debug("closing NATS: %s", exc)

    return asyncio.run(main())


# --------------------------------------------------------------------------
# Input checks (shared by the argparse types and the commands)
# --------------------------------------------------------------------------


def canonical_model(config: Config, name: str) -> str:
    """The configured model's name for a name or alias; unknown names stay as
    given (the deployment may configure models this config does not know)."""
    model = config.model_index().get(name)
    if model is None:
        print(f"tidegate: note: model {name!r} is not in this config's models; "
              "stored as given", file=sys.stderr)
        return name
    return model.name


def parse_models(value: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``; empty names are an error."""
    names = tuple(part.strip() for part in value.split(","))
    if not value.strip() or any(not n for n in names):
        raise UsageError(f"--models: expected comma-separated model names, got {value!r}")
    return names


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------


def parse_duration(value: str) -> float:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"30d"``, ``"1h30m"`` or plain seconds -> seconds."""
    text = value.strip().lower()
    if not text:
        raise UsageError("expected a duration such as 90s, 15m, 1h or 30d")
    try:
        return float(text)
    except ValueError:
        pass
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    total, number = 0.0, ""
    for char in text:
        if char.isdigit() or char == ".":
            number += char
        elif char in units and number:
            total += float(number) * units[char]
            number = ""
        else:
            raise UsageError(f"expected a duration such as 90s, 15m, 1h or 30d, got {value!r}")
    if number:
        raise UsageError(f"a duration needs a unit (s, m, h, d, w), got {value!r}")
    return total


def timestamp_text(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def print_table(header: list[str], rows: list[list[Any]]) -> None:
    cells = [[shown(cell) for cell in row] for row in [header, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
