"""Poll a condition with a deadline: how tests wait for something to happen.

A fixed sleep either wastes time or, on a loaded machine, is too short and the
test passes or fails for the wrong reason. These helpers poll the condition
the test actually depends on and fail with ``what`` when it never holds.

Both return the predicate's first truthy value, so a poll can also fetch
what it waited for (``record = await eventually(lambda: find(x), ...)``).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(predicate: Callable[[], T | Awaitable[T]], within: float, what: str,
                     step: float = 0.02) -> T:
    """Poll ``predicate`` (sync or async) every ``step`` s until it returns a
    truthy value; ``AssertionError(what)`` if none within ``within`` s.
    Exceptions from the predicate count as "not yet" until the deadline,
    then the last one is chained to the failure."""
    deadline = time.monotonic() + within
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if inspect.isawaitable(value):
                value = await value
            if value:
                return value  # type: ignore[return-value]
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within:g}s: {what}") from last
        await asyncio.sleep(step)


def eventually_sync(predicate: Callable[[], T], within: float, what: str,
                    step: float = 0.02) -> T:
    """:func:`eventually` for synchronous tests."""
    deadline = time.monotonic() + within
    last: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {within:g}s: {what}") from last
        time.sleep(step)
