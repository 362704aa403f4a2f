"""Running one tier as a process: event loop, signals, exit code.

Every tier exposes ``async def serve(config: Config, stop: asyncio.Event)``:
it runs until ``stop`` is set, then stops taking work, lets in-flight work
finish within its deadline, closes and returns. The first SIGINT/SIGTERM sets
``stop``; a second exits at once (128 + signal number).

:func:`run_service` maps the outcome to an exit code: 0 for a normal return,
2 for a :class:`~tidegate.errors.ConfigError`, 1 for any other
:class:`~tidegate.errors.TidegateError` (one log line, no traceback, also
inside a TaskGroup) and 1 for anything else (logged with its traceback: a bug).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

from tidegate.config import Config
from tidegate.errors import ConfigError, TidegateError

Serve = Callable[[Config, asyncio.Event], Awaitable[None]]

log = logging.getLogger("tidegate.runtime")

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop when it is installed (faster sockets), else asyncio's default."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


# Seconds after a stop signal past which a tier logs the tasks it still waits on.
STOP_REPORT_AFTER = 10.0


def _awaiting(coro: Any) -> str:
    """Where a task waits: its chain of awaited coroutines, outermost first."""
    names: list[str] = []
    while coro is not None and len(names) < 10:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            names.append(type(coro).__name__)
            break
        names.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(names) or "?"


def _force_exit(signum: int) -> None:
    log.warning("second %s: exiting now without cleanup", signal.Signals(signum).name)
    logging.shutdown()
    os._exit(128 + signum)


async def _main(serve: Serve, config: Config) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            _force_exit(signum)
        log.info("%s: shutting down", signal.Signals(signum).name)
        stop.set()
        loop.call_later(STOP_REPORT_AFTER, _report_stop)

    def _report_stop() -> None:
        # A stop that takes this long waits on something: say what, so a
        # slow stop under load can be read from the tier's log.
        for task in asyncio.all_tasks(loop):
            log.warning("still stopping after %gs: task %s at %s", STOP_REPORT_AFTER,
                        task.get_name(), _awaiting(task.get_coro()))

    installed: list[signal.Signals] = []
    previous: dict[signal.Signals, object] = {}
    for sig in _SIGNALS:
        try:
            loop.add_signal_handler(sig, on_signal, int(sig))
            installed.append(sig)
        except (NotImplementedError, RuntimeError):
            # No loop signal support (Windows, or not the main thread): use a
            # plain handler that hops onto the loop thread.
            def handler(signum: int, _frame: FrameType | None) -> None:
                loop.call_soon_threadsafe(on_signal, signum)

            try:
                previous[sig] = signal.signal(sig, handler)
            except ValueError:
                pass  # not the main thread: the caller owns signals
    try:
        await serve(config, stop)
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
        for sig, old in previous.items():
            signal.signal(sig, old)  # type: ignore[arg-type]


def freeze_startup_heap() -> None:
    """Exempt what exists now (modules, config, the app's long-lived objects)
    from the cyclic GC, after collecting any garbage among it.

    A full collection walks every tracked object; a tier's startup heap is
    most of them and never becomes garbage, so walking it is pure pause. At
    c=200 the edge's full collections took 23-67 ms (a stall of every stream
    on that edge, and the tail of TTFT); after freezing, 3 ms. For a tier
    process's entry point only (the CLI), not for library callers: frozen
    objects stay out of cyclic collection for the life of the process."""
    gc.collect()
    gc.freeze()


def _expected(exc: BaseException) -> TidegateError | None:
    """The error to report in one line: ``exc`` itself, or what a TaskGroup
    wrapped when every error in the group is expected (a port taken under
    ``instrumented``'s TaskGroup is still the user's to fix, not a bug). A
    group holding anything else is a bug: None, and its traceback is logged."""
    if isinstance(exc, TidegateError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        found = [_expected(e) for e in exc.exceptions]
        if found and all(e is not None for e in found):
            return next((e for e in found if isinstance(e, ConfigError)), found[0])
    return None


def run_service(serve: Serve, config: Config) -> int:
    """Run ``serve`` on a fresh event loop until it returns; the process exit code."""
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            runner.run(_main(serve, config))
    except KeyboardInterrupt:
        # Only reachable when the loop could not install its handler.
        return 128 + signal.SIGINT
    except Exception as exc:
        expected = _expected(exc)
        if isinstance(expected, ConfigError):
            log.error("invalid configuration: %s", expected)
            return 2
        if expected is not None:
            log.error("%s", expected)
            return 1
        log.exception("service failed")
        return 1
    finally:
        sys.stdout.flush()
    return 0


async def wait_for_signal() -> None:
    """Return on the first SIGINT or SIGTERM (helper processes such as the
    bench's fake backend and proxy, which clean up after it)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
