"""tidegate.runtime.run_service: signals set the stop event; outcomes map to exit codes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

from fleet.run import runtime
from fleet.run.runtime import run_service
from tidegate.config import Config
from tidegate.errors import BrokerError, ConfigError


def test_sigterm_sets_stop_and_exits_0() -> None:
    seen: list[str] = []

    async def serve(config: Config, stop: asyncio.Event) -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await asyncio.wait_for(stop.wait(), 5)
        seen.append("stopped")

    assert run_service(serve, Config()) == 0
    assert seen == ["stopped"]


def test_errors_map_to_exit_codes() -> None:
    async def bad_config(config: Config, stop: asyncio.Event) -> None:
        raise ConfigError("edge.port: nope")

    async def broker_down(config: Config, stop: asyncio.Event) -> None:
        raise BrokerError("nats unreachable")

    async def bug(config: Config, stop: asyncio.Event) -> None:
        raise RuntimeError("bug")

    assert run_service(bad_config, Config()) == 2
    assert run_service(broker_down, Config()) == 1
    assert run_service(bug, Config()) == 1


def test_uses_uvloop_when_installed() -> None:
    loops: list[str] = []

    async def serve(config: Config, stop: asyncio.Event) -> None:
        loops.append(type(asyncio.get_running_loop()).__module__)

    assert run_service(serve, Config()) == 0
    try:
        import uvloop  # noqa: F401
    except ImportError:
        assert loops[0].startswith("asyncio")
    else:
        assert loops[0].startswith("uvloop")


def test_second_signal_forces_exit() -> None:
    script = textwrap.dedent("""
        import asyncio, os, signal
        from tidegate.config import Config
        from fleet.run.runtime import run_service

        async def serve(config, stop):
            os.kill(os.getpid(), signal.SIGTERM)
            await stop.wait()
            os.kill(os.getpid(), signal.SIGINT)   # cleanup hangs: operator insists
            await asyncio.sleep(30)

        raise SystemExit(run_service(serve, Config()))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=20)
    assert result.returncode == 128 + signal.SIGINT, result.stderr


def test_freeze_startup_heap_collects_then_freezes() -> None:
    """Run in a child: freezing the test runner's heap would outlive this test."""
    code = textwrap.dedent("""
        import gc, weakref
        from fleet.run.runtime import freeze_startup_heap

        class Node:
            pass

        kept = [Node() for _ in range(50_000)]
        a, b = Node(), Node()
        a.other, b.other = b, a  # garbage only the cyclic GC can free
        gone = weakref.ref(a)
        del a, b
        gc.disable()  # nothing collects it but freeze_startup_heap's own pass
        freeze_startup_heap()
        assert gone() is None, "garbage was frozen instead of collected"
        assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


async def test_a_slow_stop_names_the_awaits_a_task_is_in() -> None:
    """A tier still stopping after STOP_REPORT_AFTER logs each task's chain of
    awaits (a suspended task's own stack holds only its outermost frame)."""
    async def inner() -> None:
        await asyncio.sleep(10)

    async def outer() -> None:
        await inner()

    task = asyncio.create_task(outer())
    await asyncio.sleep(0)
    where = runtime._awaiting(task.get_coro())
    task.cancel()
    assert where.startswith("outer:"), where
    assert " > inner:" in where, where
