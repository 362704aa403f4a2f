"""Logging setup for tidegate processes: stdlib logging, plain or JSON lines.

Library code only gets loggers (``logging.getLogger("tidegate.edge")`` or
:func:`get`) and passes context with ``extra=``; only the CLI calls
:func:`setup`, once per process. Both formats show every ``extra`` field.

:func:`bind`, called once per request by the edge, the dispatcher and a job,
puts ``request_id``, ``session``, ``tenant`` and ``trace_id`` on every line of
that task and its children (an ``extra=`` of the same name wins). The
configured level applies to tidegate's loggers; third-party libraries log at
WARNING and above. Docs: docs/observability.md.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import IO, Any, NamedTuple

from tidegate.config import LoggingConfig

#: Loggers whose level follows ``logging.level``. Tiers log under
#: ``tidegate.<tier>``; the package names cover ``getLogger(__name__)``.
COMPONENT_LOGGERS = ("tidegate", "edge", "dispatcher", "workers", "fleet")

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName",
}
_MARK = "_tidegate_handler"


class RequestContext(NamedTuple):
    request_id: str
    tenant: str = ""
    trace_id: str = ""


_context: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar(
    "tidegate_log_context", default=None)


def bind(request_id: str, tenant: str = "", trace_id: str = "") -> contextvars.Token[
        RequestContext | None]:
    """Tag every later line of the current task with this request.

    Returns the token for :func:`unbind`; a task that ends right after its
    request (a job task) need not bother, its context ends with it.
    """
    return _context.set(RequestContext(request_id, tenant, trace_id))


def unbind(token: contextvars.Token[RequestContext | None]) -> None:
    _context.reset(token)


def current() -> RequestContext | None:
    return _context.get()


class ContextFilter(logging.Filter):
    """Adds the bound request's fields to each record (never drops one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = _context.get()
        if ctx is not None:
            fields = vars(record)
            fields.setdefault("request_id", ctx.request_id)
            fields.setdefault("session", ctx.request_id)
            if ctx.tenant:
                fields.setdefault("tenant", ctx.tenant)
            if ctx.trace_id:
                fields.setdefault("trace_id", ctx.trace_id)
        return True


def get(component: str) -> logging.Logger:
    """The logger of a component: ``get("edge")`` is ``tidegate.edge``."""
    return logging.getLogger(f"tidegate.{component}")


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` fields of a record, in the order they were given."""
    return {k: v for k, v in vars(record).items()
            if k not in _STANDARD_ATTRS and not k.startswith("_")}


def _timestamp(record: logging.LogRecord) -> str:
    """UTC, ISO 8601 with milliseconds: sortable and unambiguous across hosts."""
    secs = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{secs}.{int(record.msecs):03d}Z"


class PlainFormatter(logging.Formatter):
    """``ts LEVEL logger: msg key=value ...`` for humans at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        fields = extras(record)
        if fields:
            line += " " + " ".join(f"{k}={_plain(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def _plain(value: Any) -> str:
    text = str(value)
    return json.dumps(text) if (not text or any(c.isspace() or c == '"' for c in text)) else text


class JsonFormatter(logging.Formatter):
    """One JSON object per line; never raises on a value json cannot encode."""

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in extras(record).items():
            if key not in obj:
                obj[key] = value
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def setup(config: LoggingConfig, stream: IO[str] | None = None) -> None:
    """Configure the root logger for this process (idempotent).

    Replaces a handler installed by an earlier call instead of adding a second
    one; leaves handlers installed by others (pytest's capture) alone.
    """
    level = logging.getLevelName(config.level.upper())
    if not isinstance(level, int):
        raise ValueError(f"unknown log level {config.level!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if config.json else PlainFormatter())
    handler.addFilter(ContextFilter())
    setattr(handler, _MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(max(level, logging.WARNING))
    for name in COMPONENT_LOGGERS:
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(True)
