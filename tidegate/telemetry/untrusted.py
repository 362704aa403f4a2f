"""Accounting for input a tier drops: rate-limited logs plus a counter.

Anything a process reads from a socket or from NATS is untrusted: a buggy or
hostile client of the same broker can publish garbage on any subject a tier
listens to. The rule for every tier is the same: drop the message, count it
(``tidegate.broker.bad_messages`` / ``tidegate.edge.connections.refused``),
log it, keep serving. The log is rate-limited (one line per reason per
interval, carrying how many were suppressed) because a flood of garbage must
not turn into a flood of log lines, which would be a denial of service of its
own (disk, log shipping).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tidegate.telemetry import telemetry


class RateLimitedLog:
    """At most one line per ``key`` per ``interval`` seconds."""

    __slots__ = ("_clock", "_interval", "_last", "_logger", "_suppressed")

    def __init__(self, logger: logging.Logger, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, message: str, *args: object) -> bool:
        """Log ``message`` unless ``key`` was logged within the interval.
        Returns whether a line was written."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        if len(self._last) > 1024:  # keys come from a fixed set; bound it anyway
            self._last.clear()
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        suffix = f" ({suppressed} more suppressed)" if suppressed else ""
        self._logger.warning(message + suffix, *args)
        return True


class BadInput:
    """One tier's drop accounting: ``drop(kind, reason, detail)`` counts and logs."""

    __slots__ = ("_log", "_tier")

    def __init__(self, tier: str, logger: logging.Logger, interval: float = 10.0) -> None:
        self._tier = tier
        self._log = RateLimitedLog(logger, interval)

    def drop(self, kind: str, reason: str, detail: str = "") -> None:
        """A message on a ``kind`` subject was dropped for ``reason``."""
        telemetry.get().metrics.bad_messages.add(
            1, {telemetry.TIER: self._tier, telemetry.SUBJECT_KIND: kind,
                telemetry.REASON: reason})
        self._log.warning(f"{kind}:{reason}", "dropped a bad message on a %s subject (%s): %s",
                          kind, reason, detail[:200])
