"""The deadline every request body read at the edge runs under.

Every body read (JSON bodies, uploads, the batch create body) runs inside
:func:`deadline`: ``edge.body_timeout`` seconds, plus one second per
``edge.body_min_rate`` bytes received so far, so an honest large upload keeps
earning time and a trickle gets 408 ``request_timeout``.

Invariant: nothing is paid per chunk; one timer re-checks the stream's byte
count (``StreamReader.total_bytes``) when the deadline comes. A handler slow to
pass chunks on pauses the read and counts as slow too; ``body_timeout`` is the
slack for that. Docs: docs/security.md#connections-edgeguardpy.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web

from tidegate.config.sections import EdgeConfig
from tidegate.errors import ApiError

__all__ = ["BodyDeadline", "deadline", "read_within"]


@dataclass(frozen=True, slots=True)
class BodyDeadline:
    """When a body that started at ``start`` must have delivered ``received``
    bytes by (sans-I/O: times are whatever clock ``start`` came from)."""

    timeout: float
    min_rate: float  # bytes/s; 0 = the fixed ``timeout`` only
    start: float

    def at(self, received: int) -> float:
        earned = received / self.min_rate if self.min_rate > 0 else 0.0
        return self.start + self.timeout + earned


def timed_out(config: EdgeConfig) -> ApiError:
    rate = (f" (plus one second per {config.body_min_rate:g} bytes received)"
            if config.body_min_rate > 0 else "")
    return ApiError(408, f"The request body did not arrive within {config.body_timeout:g} "
                         f"seconds{rate}.", type="invalid_request_error",
                    code="request_timeout")


@contextlib.asynccontextmanager
async def deadline(request: web.BaseRequest, config: EdgeConfig) -> AsyncIterator[None]:
    """Run the body read in the ``with`` block under the body deadline;
    408 ``request_timeout`` when it passes. Only this deadline's expiry is a
    408: a ``TimeoutError`` of something else inside (a NATS request) is not."""
    loop = asyncio.get_running_loop()
    stream = request.content
    rule = BodyDeadline(config.body_timeout, config.body_min_rate, loop.time())
    handle: asyncio.TimerHandle | None = None
    scope = asyncio.timeout(None)

    def check() -> None:
        nonlocal handle
        when = rule.at(stream.total_bytes)
        if when <= loop.time():
            scope.reschedule(loop.time())  # expires now: cancels the reader
        else:
            handle = loop.call_at(when, check)

    try:
        async with scope:
            handle = loop.call_at(rule.at(0), check)
            yield
    except TimeoutError:
        if scope.expired():
            raise timed_out(config) from None
        raise
    finally:
        if handle is not None:
            handle.cancel()


async def read_within(request: web.BaseRequest, config: EdgeConfig) -> bytes:
    """``request.read()`` under the body deadline. aiohttp keeps what it read,
    so a later ``request.read()`` returns the same bytes without waiting."""
    async with deadline(request, config):
        return await request.read()
