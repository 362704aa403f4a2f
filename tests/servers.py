"""Test helpers: real nats-server / redis-server, and process inspection via /proc.

Servers come from local binaries (:mod:`fleet.run.servers`, the same code
``tidegate up`` uses) unless a Docker engine actually answers, in which case
testcontainers' NATS/Redis containers are used. ``TIDEGATE_TEST_SERVERS``
forces the choice: ``local``, ``docker`` or ``auto`` (the default).

Both kinds satisfy :class:`ServerHandle`, so fault tests can ``kill()`` and
``restart()`` a server without knowing which kind it is; a restart always comes
back on the same host port.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from fleet.run.clusters import NatsCluster, RedisCluster
from fleet.run.servers import NatsServer, RedisServer, free_port


class ServerHandle(Protocol):
    host: str
    port: int

    @property
    def url(self) -> str: ...

    def stop(self, timeout: float = 10.0) -> int | None: ...

    def kill(self) -> None: ...

    def restart(self, timeout: float | None = None) -> None: ...


def server_kind() -> str:
    """``local`` or ``docker``, per ``TIDEGATE_TEST_SERVERS`` and what answers."""
    wanted = os.environ.get("TIDEGATE_TEST_SERVERS", "auto")
    if wanted == "local":
        return "local"
    if wanted == "docker":
        if not docker_engine_available():
            raise RuntimeError("TIDEGATE_TEST_SERVERS=docker but no Docker engine answers")
        return "docker"
    return "docker" if docker_engine_available() else "local"


@functools.cache
def docker_engine_available() -> bool:
    """True only when testcontainers is installed and a Docker engine answers a ping.

    A ``docker`` client binary alone is not enough (it exists on machines with
    no engine), hence the ping.
    """
    try:
        import docker  # type: ignore[import-untyped, unused-ignore]
        import testcontainers  # noqa: F401
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=3)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def start_nats(data_dir: Path) -> ServerHandle:
    if server_kind() == "docker":
        return ContainerServer.nats()
    server = NatsServer(data_dir)
    server.start()
    return server


def start_redis(data_dir: Path) -> ServerHandle:
    if server_kind() == "docker":
        return ContainerServer.redis()
    server = RedisServer(data_dir)
    server.start()
    return server


def start_nats_cluster(data_dir: Path, size: int = 3) -> NatsCluster:
    """A JetStream cluster of local nats-servers (routes, server names, own stores)."""
    cluster = NatsCluster(data_dir, size=size)
    cluster.start()
    return cluster


def start_redis_cluster(data_dir: Path, size: int = 3) -> RedisCluster:
    """A Redis Cluster of ``size`` local primaries, slots assigned, ``cluster_state:ok``."""
    cluster = RedisCluster(data_dir, size=size)
    cluster.start()
    return cluster


class ContainerServer:
    """A testcontainers container bound to a fixed host port, so restarts keep it."""

    def __init__(self, container: Any, internal_port: int, scheme: str, suffix: str,
                 ready: str) -> None:
        self.host = "127.0.0.1"
        self.port = free_port()
        self._container = container.with_bind_ports(internal_port, self.port)
        self._scheme, self._suffix, self._ready = scheme, suffix, ready
        self._container.start()
        self._wait_ready(60.0)

    @classmethod
    def nats(cls) -> ContainerServer:
        from testcontainers.nats import NatsContainer

        container = NatsContainer("nats:2.10-alpine").with_command("-js -m 8222")
        return cls(container, 4222, "nats", "", "nats")

    @classmethod
    def redis(cls) -> ContainerServer:
        from testcontainers.redis import RedisContainer

        return cls(RedisContainer("redis:7-alpine"), 6379, "redis", "/0", "redis")

    @property
    def url(self) -> str:
        return f"{self._scheme}://{self.host}:{self.port}{self._suffix}"

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._probe():
                return
            time.sleep(0.1)
        raise TimeoutError(f"container {self.url} not ready within {timeout}s")

    def _probe(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                if self._ready == "redis":
                    s.sendall(b"PING\r\n")
                    return s.recv(64).startswith(b"+PONG")
                return s.recv(4).startswith(b"INFO")
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> int | None:
        self._container.stop()
        return 0

    def kill(self) -> None:
        self._container.get_wrapped_container().kill()

    def restart(self, timeout: float | None = None) -> None:
        self._container.get_wrapped_container().restart()
        self._wait_ready(timeout or 60.0)


# --------------------------------------------------------------------------
# /proc (psutil is not a dependency)
# --------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return raw[raw.rindex(")") + 2:].split()  # the name may contain spaces and ")"


def proc_identity(pid: int) -> tuple[int, int] | None:
    """``(pid, start time)``: stays unique even if the pid is later reused."""
    fields = _stat(pid)
    return None if fields is None else (pid, int(fields[19]))


def is_alive(identity: tuple[int, int]) -> bool:
    """True if that exact process (not a reused pid) exists and is not a zombie."""
    pid, start = identity
    fields = _stat(pid)
    return fields is not None and int(fields[19]) == start and fields[0] != "Z"


def descendants(pid: int) -> list[tuple[int, int]]:
    """Identities of every live descendant of ``pid`` (children, their children...)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[tuple[int, int]] = []
    todo = list(parents.get(pid, ()))
    while todo:
        child = todo.pop()
        identity = proc_identity(child)
        if identity is not None:
            out.append(identity)
        todo.extend(parents.get(child, ()))
    return out


def wait_until(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until true or ``timeout``; its last value."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def kill_all(identities: Iterable[tuple[int, int]]) -> None:
    """SIGKILL the processes still alive (test cleanup after a failure)."""
    import signal

    for identity in identities:
        if is_alive(identity):
            try:
                os.kill(identity[0], signal.SIGKILL)
            except ProcessLookupError:
                pass


__all__ = [
    "ContainerServer",
    "ServerHandle",
    "descendants",
    "docker_engine_available",
    "is_alive",
    "kill_all",
    "proc_identity",
    "start_nats",
    "start_nats_cluster",
    "start_redis",
    "start_redis_cluster",
    "wait_until",
]
