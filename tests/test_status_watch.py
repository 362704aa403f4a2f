"""A watching ``tidegate status`` whose NATS goes away: it says so in one
line, reconnects when NATS is back, and never prints a traceback.

Real servers: the test starts its own nats-server and redis-server on free
ports and kills and restarts only that nats-server.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from fleet.run.status import until_interrupted
from tests.poll import eventually_sync
from tests.servers import ServerHandle

# Generous: a loaded machine starts Python and nats-server slowly.
WITHIN = 60.0


class Watch:
    """``tidegate status`` (the live view) in a child process, its output
    read line by line as it comes."""

    def __init__(self, nats_url: str, redis_url: str) -> None:
        env = {**os.environ, "COLUMNS": "80"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet", "status", "--nats-url", nats_url,
             "--redis-url", redis_url, "--interval", "0.3"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.stderr = ""
        self._readers = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._read_err, daemon=True)]
        for t in self._readers:
            t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = self.proc.stderr.read()

    def wait_line(self, start: int, predicate: str, what: str) -> int:
        """The index of the first line from ``start`` on containing ``predicate``."""
        def found() -> int | None:
            return next((i for i in range(start, len(self.lines))
                         if predicate in self.lines[i]), None)

        def found_or_died() -> bool:
            return found() is not None or self.proc.poll() is not None

        eventually_sync(found_or_died, WITHIN, what)
        index = found()
        assert index is not None, (f"{what}: status exited {self.proc.returncode}\n"
                                   + "\n".join(self.lines[-40:]) + "\n" + self.stderr)
        return index

    def stop(self) -> int:
        """Ctrl-C, as a person ends the view; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        return self.wait_exit()

    def wait_exit(self) -> int:
        """The exit code, once the output is read to its end."""
        code = self.proc.wait(timeout=WITHIN)
        for t in self._readers:
            t.join(WITHIN)
        return code

    def kill(self) -> None:
        """Only the status this test started."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=WITHIN)


@pytest.fixture
def watch(nats_server: ServerHandle, redis_server: ServerHandle) -> Iterator[Watch]:
    w = Watch(nats_server.url, redis_server.url)
    try:
        yield w
    finally:
        w.kill()


def test_watching_status_survives_nats_stopping_and_coming_back(
        nats_server: ServerHandle, watch: Watch) -> None:
    first = watch.wait_line(0, "Models", "the first view")
    assert watch.wait_line(first, "tidegate-sim", "the model's row") > first

    nats_server.kill()
    lost = watch.wait_line(first, "lost NATS", "a line saying NATS went away")
    line = watch.lines[lost]
    assert line.startswith("tidegate status: lost NATS at " + nats_server.url), line
    assert "reconnecting" in line, line
    assert watch.proc.poll() is None, "status exited instead of reconnecting"

    nats_server.restart()
    back = watch.wait_line(lost, "is back", "a line saying NATS is back")
    watch.wait_line(back, "Models", "the view again after the reconnect")
    # One line for the outage, not one per retry (a pipe keeps every line).
    outage = watch.lines[lost:back + 1]
    assert sum("lost NATS" in line for line in outage) == 1, outage

    assert watch.stop() == 0
    assert "Traceback" not in watch.stderr, watch.stderr
    assert not any("Traceback" in line for line in watch.lines)
    assert all(len(line) <= 80 for line in watch.lines if "NATS" not in line), [
        line for line in watch.lines if len(line) > 80]


def test_watching_status_without_nats_at_start_fails_in_one_line() -> None:
    """No NATS when the view starts is an error at once (exit 1), as it is
    for --json: a mistyped URL should not look like an outage to wait out."""
    w = Watch("nats://127.0.0.1:1", "redis://127.0.0.1:1")
    try:
        code = w.wait_exit()
    finally:
        w.kill()
    assert code == 1
    assert "Traceback" not in w.stderr, w.stderr
    assert w.stderr.strip().count("\n") == 0, w.stderr
    assert "cannot reach NATS at nats://127.0.0.1:1" in w.stderr, w.stderr


async def test_ctrl_c_ends_a_view_that_swallows_one_cancellation() -> None:
    """A library call that swallows the view's cancellation must not keep
    the view running: Ctrl-C ends it all the same."""
    swallowed = 0

    async def view() -> int:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 1:
                    raise  # the second cancellation goes through

    async def interrupt() -> None:
        await asyncio.sleep(0.05)  # the view waits by now
        os.kill(os.getpid(), signal.SIGINT)

    poke = asyncio.ensure_future(interrupt())
    assert await until_interrupted(view(), grace=3600) == 0
    await poke
    assert swallowed == 2
