"""tidegate.servers: real nats-server and redis-server processes.

The fixtures (``nats_server``, ``redis_server``) are what every integration test
uses; the ``NatsServer``/``RedisServer`` tests below exercise the local
process management itself (stop, kill, restart, start failure, parent death).
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nats
import pytest
import redis.asyncio as aioredis
from nats.js.api import StreamConfig

from fleet.run.servers import (
    ManagedProcess,
    NatsServer,
    RedisServer,
    find_nats_server,
    find_redis_server,
    free_port,
    log_tail,
    port_is_free,
    private_dir,
)
from tests.servers import ServerHandle, is_alive, proc_identity, wait_until
from tidegate.errors import TidegateError


async def _nats_roundtrip(url: str, stream: str = "T") -> int:
    """Create (or find) a stream, publish one message; the stream's message count."""
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{stream.lower()}.>"]))
        await js.publish(f"{stream.lower()}.x", b"hello")
        info = await js.stream_info(stream)
        return int(info.state.messages)
    finally:
        await nc.close()


# -- fixtures ------------------------------------------------------------------


async def test_nats_fixture_has_jetstream(nats_server: ServerHandle) -> None:
    nc = await nats.connect(nats_server.url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        info = await nc.jetstream().account_info()
        assert info.limits is not None
    finally:
        await nc.close()
    assert await _nats_roundtrip(nats_server.url) == 1


async def test_redis_fixture_answers_ping(redis_server: ServerHandle) -> None:
    client = aioredis.from_url(redis_server.url)
    try:
        assert await client.ping() is True
        await client.set("k", "v")
        assert await client.get("k") == b"v"
    finally:
        await client.aclose()


def test_fixtures_never_use_the_default_ports(nats_server: ServerHandle,
                                              redis_server: ServerHandle) -> None:
    assert nats_server.port != 4222
    assert redis_server.port != 6379


# -- binaries and ports ----------------------------------------------------------


def test_find_nats_server_is_recent() -> None:
    out = subprocess.run([find_nats_server(), "--version"], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    found = re.search(r"v(\d+)\.(\d+)", out)
    assert found, out
    major, minor = int(found[1]), int(found[2])
    assert (major, minor) >= (2, 10), out


def test_find_redis_server_runs() -> None:
    out = subprocess.run([find_redis_server(), "--version"], capture_output=True, text=True,
                         check=True, timeout=10).stdout
    assert "Redis server" in out


def test_free_port_prefers_a_free_port_and_skips_a_taken_one() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        assert not port_is_free(taken)
        other = free_port(preferred=taken)
        assert other != taken
        assert port_is_free(other)
    assert free_port(preferred=taken) == taken  # closed: free again


def test_free_port_picks_below_the_ephemeral_range() -> None:
    """The ports `tidegate up` picks for its servers are not ones an outgoing
    connection's source port can take between the pick and the bind (the
    race that failed `tidegate up` with "port in use" on a busy machine)."""
    from fleet.run.ports import ephemeral_start

    picks = {free_port() for _ in range(50)}
    assert all(port < ephemeral_start() for port in picks), sorted(picks)
    assert len(picks) > 40  # drawn at random, not one port over and over


# -- process management ------------------------------------------------------------


def _assert_gone(server: ManagedProcess, identity: tuple[int, int] | None, port: int) -> None:
    assert identity is not None
    assert not server.running
    assert wait_until(lambda: not is_alive(identity), 5)
    assert port_is_free(port)


@pytest.mark.pipeline
async def test_nats_stop_leaves_no_process_and_frees_the_port(tmp_path: Path) -> None:
    server = NatsServer(tmp_path)
    server.start()
    assert server.pid is not None
    identity = proc_identity(server.pid)
    assert await _nats_roundtrip(server.url) == 1
    assert server.stop(timeout=10) == 0  # SIGTERM is a clean exit, not a kill
    _assert_gone(server, identity, server.port)
    assert port_is_free(server.monitor_port)
    assert (tmp_path / "nats-server.log").exists()


@pytest.mark.pipeline
def test_nats_gomaxprocs_reaches_the_server_and_only_it(tmp_path: Path) -> None:
    """The benchmark runs nats-server with one Go thread: the setting must be
    in the server's environment, the rest of the environment kept, and the
    default must leave GOMAXPROCS to whoever started us."""
    capped = NatsServer(tmp_path / "capped", gomaxprocs=1)
    default = NatsServer(tmp_path / "default")
    try:
        capped.start()
        default.start()
        assert capped.pid is not None
        assert default.pid is not None
        environ = Path(f"/proc/{capped.pid}/environ").read_bytes().split(b"\0")
        assert b"GOMAXPROCS=1" in environ
        assert f"PATH={os.environ['PATH']}".encode() in environ
        inherited = os.environ.get("GOMAXPROCS")
        defaults = Path(f"/proc/{default.pid}/environ").read_bytes().split(b"\0")
        assert [e for e in defaults if e.startswith(b"GOMAXPROCS=")] == (
            [] if inherited is None else [f"GOMAXPROCS={inherited}".encode()])
        assert capped.is_ready()  # JetStream up with one Go thread
    finally:
        capped.stop(timeout=10)
        default.stop(timeout=10)


@pytest.mark.pipeline
async def test_redis_stop_leaves_no_process_and_frees_the_port(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    assert server.pid is not None
    identity = proc_identity(server.pid)
    assert server.stop(timeout=10) == 0
    _assert_gone(server, identity, server.port)


@pytest.mark.pipeline
async def test_nats_restart_on_the_same_port_keeps_jetstream_state(tmp_path: Path) -> None:
    server = NatsServer(tmp_path)
    server.start()
    try:
        port, url = server.port, server.url
        assert await _nats_roundtrip(url) == 1
        server.kill()  # abrupt, as a crash would be
        assert not server.running
        server.restart()
        assert (server.port, server.url) == (port, url)
        assert await _nats_roundtrip(url) == 2  # the stream and its message survived
    finally:
        server.stop()


@pytest.mark.pipeline
async def test_clients_reconnect_across_a_nats_restart(tmp_path: Path) -> None:
    server = NatsServer(tmp_path)
    server.start()
    reconnected = asyncio.Event()

    async def on_reconnect() -> None:
        reconnected.set()

    nc = await nats.connect(server.url, reconnect_time_wait=0.1, max_reconnect_attempts=-1,
                            reconnected_cb=on_reconnect)
    try:
        server.restart()
        await asyncio.wait_for(reconnected.wait(), 10)
        assert (await nc.jetstream().account_info()) is not None
    finally:
        await nc.close()
        server.stop()


@pytest.mark.pipeline
async def test_redis_restart_on_the_same_port(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        port = server.port
        server.kill()
        server.restart()
        assert server.port == port
        client = aioredis.from_url(server.url)
        try:
            assert await client.ping() is True
        finally:
            await client.aclose()
    finally:
        server.stop()


@pytest.mark.pipeline
def test_start_failure_kills_the_child_and_shows_its_log(tmp_path: Path) -> None:
    child = ManagedProcess(
        "sleeper",
        [sys.executable, "-c", "print('hello from the child', flush=True); "
                               "import time; time.sleep(60)"],
        tmp_path / "sleeper.log", ready=lambda: False)
    with pytest.raises(TidegateError) as info:
        child.start(timeout=1.0)
    message = str(info.value)
    assert "sleeper was not ready within 1s" in message
    assert "hello from the child" in message
    assert not child.running


@pytest.mark.pipeline
def test_child_that_exits_while_starting_is_reported(tmp_path: Path) -> None:
    missing = tmp_path / "missing.conf"
    server = NatsServer(tmp_path, extra_args=["-c", str(missing)])
    with pytest.raises(TidegateError, match=r"nats-server exited with code \d+ while starting") \
            as info:
        server.start()
    assert "no such file" in log_tail(tmp_path / "nats-server.log")
    assert "no such file" in str(info.value)  # the log tail is in the message


@pytest.mark.pipeline
def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    ignorer = ManagedProcess(
        "stubborn",
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                               "signal.SIG_IGN); print('REA' + 'DY', flush=True); time.sleep(60)"],
        tmp_path / "stubborn.log",
        ready=lambda: "READY" in log_tail(tmp_path / "stubborn.log"))
    ignorer.start()
    started = time.monotonic()
    assert ignorer.stop(timeout=0.5) == -9
    assert time.monotonic() - started < 5


class _RestartedAtOnce(ManagedProcess):
    """A child whose supervisor (another thread) starts the next process as
    soon as the killed one has exited, before ``kill`` returns."""

    restarts = 1

    def send_signal(self, sig: int) -> None:
        super().send_signal(sig)
        if self.restarts:
            self.restarts -= 1
            assert self._proc is not None
            self._proc.wait()
            self.spawn()


def test_kill_leaves_the_next_process_alone(tmp_path: Path) -> None:
    """``kill`` SIGKILLs the group of the process it killed, not of one a
    supervisor started meanwhile (tidegate chaos lost a NATS node's restart
    that way, and the run hung)."""
    child = _RestartedAtOnce("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                             tmp_path / "sleeper.log")
    child.spawn()
    first = child.pid
    child.kill()
    try:
        assert child.pid != first
        time.sleep(0.3)  # a SIGKILL is delivered at once; give the check a margin
        assert child.running, "the restarted process was killed too"
    finally:
        child.kill()  # the second process (no restart after it)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
@pytest.mark.pipeline
def test_server_dies_with_its_parent(tmp_path: Path) -> None:
    """A parent killed with SIGKILL cannot clean up: PR_SET_PDEATHSIG must."""
    script = textwrap.dedent(f"""
        import time
        from fleet.run.servers import RedisServer
        server = RedisServer({str(tmp_path)!r})
        server.start()
        print(server.pid, server.port, flush=True)
        time.sleep(60)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        pid, port = (int(x) for x in parent.stdout.readline().split())
        identity = proc_identity(pid)
        assert identity is not None
        assert is_alive(identity)
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    assert wait_until(lambda: not is_alive(identity), 5)
    assert wait_until(lambda: port_is_free(port), 5)


@pytest.mark.pipeline
async def test_nats_without_monitor_is_ready_with_jetstream_and_has_no_http_port(
        tmp_path: Path) -> None:
    """tidegate up's NATS: no monitoring port (it lists users to anyone);
    readiness then comes from the server's own "Server is ready" line, and
    JetStream answers at once. A restart is ready again only once it says so."""
    server = NatsServer(tmp_path, monitor=False)
    try:
        server.start()
        assert server.monitor_port is None
        assert "-m" not in server.argv
        assert await _nats_roundtrip(server.url) == 1
        server.stop(timeout=10)
        assert not server.is_ready()  # the old "ready" line is not this start's
        server.start()
        assert await _nats_roundtrip(server.url) == 2
    finally:
        server.stop(timeout=10)


@pytest.mark.pipeline
async def test_redis_with_a_password_refuses_without_it(tmp_path: Path) -> None:
    password = "pw-" + os.urandom(8).hex()
    server = RedisServer(tmp_path, password=password)
    try:
        server.start()
        assert password not in " ".join(server.argv)  # ps would show it
        assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600
        assert server.url.startswith(f"redis://:{password}@")
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
            conn.sendall(b"PING\r\n")
            assert conn.recv(64).startswith(b"-NOAUTH")
        client = aioredis.from_url(server.url)
        try:
            assert await client.ping()
        finally:
            await client.aclose()
    finally:
        server.stop(timeout=10)


def test_logs_and_data_dirs_are_the_owners_alone(tmp_path: Path) -> None:
    """tidegate up's data dir and logs (they name tenants and request ids, and
    hold the dev key): 0700 and 0600, and what an older version made 0755 and
    0644 is narrowed."""
    data, logs = tmp_path / "data", tmp_path / "data" / "logs"
    logs.mkdir(parents=True, mode=0o755)
    (logs / "old.log").write_text("")
    (logs / "old.log").chmod(0o644)
    for d in (data, logs):
        d.chmod(0o755)
        private_dir(d)
    for name in ("old", "new"):
        child = ManagedProcess(name, [sys.executable, "-c", "pass"], logs / f"{name}.log")
        child.spawn()
        child.wait(10)
    assert {d.stat().st_mode & 0o777 for d in (data, logs)} == {0o700}
    assert {f.stat().st_mode & 0o777 for f in logs.glob("*.log")} == {0o600}
