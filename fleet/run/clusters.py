"""Clusters on one machine: a 3-node JetStream cluster and a 3-primary Redis Cluster.

Used by the test suite's cluster fixtures and by ``tidegate chaos``.

Invariants: every node has its own ports and state dir, so a restarted node
(through :class:`~fleet.run.servers.ManagedProcess`) comes back with its
identity on the same ports; ``start()`` returns only once the whole cluster
serves (a JetStream meta leader and every node healthy; every Redis slot
assigned and ``cluster_state:ok``), and on failure stops everything it started.
Docs: docs/deploy.md.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from fleet.run.servers import NatsServer, RedisServer, free_port, stop_all
from tidegate.errors import TidegateError

REDIS_SLOTS = 16384


def _free_ports(count: int, taken: set[int]) -> list[int]:
    """``count`` distinct free ports, none of them in ``taken`` (which grows)."""
    out: list[int] = []
    while len(out) < count:
        port = free_port()
        if port not in taken:
            taken.add(port)
            out.append(port)
    return out


class NatsCluster:
    """Three (or ``size``) nats-servers with JetStream, routed to each other."""

    def __init__(self, data_dir: str | os.PathLike[str], size: int = 3,
                 name: str = "tidegate", start_timeout: float = 60.0,
                 gomaxprocs: int | None = None) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.data_dir = Path(data_dir)
        self.start_timeout = start_timeout
        taken: set[int] = set()
        clients, routes, monitors = (_free_ports(size, taken) for _ in range(3))
        self.nodes: list[NatsServer] = []
        for i in range(size):
            others = ",".join(f"nats://127.0.0.1:{routes[j]}" for j in range(size) if j != i)
            node = NatsServer(
                self.data_dir / f"n{i + 1}", port=clients[i], monitor_port=monitors[i],
                gomaxprocs=gomaxprocs, start_timeout=start_timeout,
                extra_args=["--server_name", f"n{i + 1}", "--cluster_name", name,
                            "--cluster", f"nats://127.0.0.1:{routes[i]}",
                            *(["--routes", others] if others else [])])
            node.name = f"nats-{i + 1}"
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (``nats.url`` takes that)."""
        return ",".join(node.url for node in self.nodes)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self) -> None:
        """Start every node, then wait for a meta leader and every node healthy."""
        try:
            for node in self.nodes:
                node.spawn()  # all at once: a lone node never gets JetStream ready
            self.wait_healthy(self.start_timeout)
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, timeout: float) -> None:
        """Until every running node is healthy and one of them sees a meta leader."""
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                code = node.poll()
                if code is not None:
                    raise TidegateError(node.describe_failure(
                        f"{node.name} exited with code {code} while the cluster formed"))
            if all(node.is_ready() for node in self.nodes) and self.meta_leader():
                return
            if time.monotonic() >= deadline:
                raise TidegateError(f"NATS cluster {self.url} not healthy within {timeout:g}s")
            time.sleep(0.1)

    def meta_leader(self) -> str:
        """The JetStream meta leader's server name ('' while there is none)."""
        for node in self.nodes:
            if not node.running:
                continue
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{node.monitor_port}/jsz", timeout=1.0) as resp:
                    doc = json.loads(resp.read())
            except (OSError, ValueError):
                continue
            leader = (doc.get("meta_cluster") or {}).get("leader") or ""
            if leader:
                return str(leader)
        return ""

    def node(self, server_name: str) -> NatsServer:
        """The node of that ``server_name`` (``n1``...)."""
        return self.nodes[int(server_name.removeprefix("n")) - 1]

    def stop(self, timeout: float = 10.0) -> None:
        stop_all(self.nodes, timeout)


class RedisCluster:
    """``size`` redis-server primaries in cluster mode, slots split evenly.

    No replicas: a killed primary's slots are down until it is restarted
    (``nodes.conf`` in its dir brings back its id and slots), which is the
    outage the dispatcher's fail-open/fail-closed handling is for.
    """

    def __init__(self, data_dir: str | os.PathLike[str], size: int = 3,
                 node_timeout_ms: int = 2000, start_timeout: float = 30.0) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.data_dir = Path(data_dir)
        self.start_timeout = start_timeout
        taken: set[int] = set()
        # The cluster bus listens on port + 10000: both must be free.
        ports: list[int] = []
        while len(ports) < size:
            (port,) = _free_ports(1, taken)
            if port + 10000 < 65536 and _bindable(port + 10000):
                ports.append(port)
        self.nodes: list[RedisServer] = []
        for i, port in enumerate(ports):
            node = RedisServer(
                self.data_dir / f"r{i + 1}", port=port, start_timeout=start_timeout,
                extra_args=["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                            "--cluster-node-timeout", str(node_timeout_ms)])
            node.name = f"redis-{i + 1}"
            self.nodes.append(node)

    @property
    def url(self) -> str:
        """``redis+cluster://`` with every node, as ``redis.url`` takes it."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> None:
        """Start the nodes, assign the slots, introduce the nodes, wait for ``ok``."""
        try:
            for node in self.nodes:
                node.start()
            size = len(self.nodes)
            for i, node in enumerate(self.nodes):
                first, last = i * REDIS_SLOTS // size, (i + 1) * REDIS_SLOTS // size - 1
                # ADDSLOTSRANGE needs Redis 7; ADDSLOTS takes the slots one by one.
                _command(node.port, "CLUSTER", "ADDSLOTS",
                         *(str(s) for s in range(first, last + 1)))
            for node in self.nodes[1:]:
                _command(self.nodes[0].port, "CLUSTER", "MEET", "127.0.0.1", str(node.port))
            self.wait_ok(self.start_timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ok(self, timeout: float) -> None:
        """Until every node says ``cluster_state:ok`` and knows every other node."""
        deadline = time.monotonic() + timeout
        while not all(self._ok(node) for node in self.nodes):
            if time.monotonic() >= deadline:
                raise TidegateError(f"Redis Cluster {self.url} not ok within {timeout:g}s")
            time.sleep(0.1)

    def _ok(self, node: RedisServer) -> bool:
        try:
            info = _command(node.port, "CLUSTER", "INFO")
        except OSError:
            return False
        fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
        return (fields.get("cluster_state") == "ok"
                and fields.get("cluster_known_nodes") == str(len(self.nodes)))

    def owner(self, key: str) -> RedisServer:
        """The primary holding ``key``'s slot (by the fixture's even split)."""
        slot = int(_command(self.nodes[0].port, "CLUSTER", "KEYSLOT", key))
        return self.nodes[slot * len(self.nodes) // REDIS_SLOTS]

    def stop(self, timeout: float = 10.0) -> None:
        stop_all(self.nodes, timeout)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _command(port: int, *args: str, timeout: float = 5.0) -> str:
    """One Redis command over RESP; the reply as text. Raises OSError on an error reply."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(
        f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        reader = s.makefile("rb")
        return _reply(reader)


def _reply(reader: object) -> str:
    line: bytes = reader.readline()  # type: ignore[attr-defined]
    kind, rest = line[:1], line[1:].rstrip(b"\r\n")
    if kind in (b"+", b":"):
        return rest.decode()
    if kind == b"-":
        raise OSError(f"redis: {rest.decode()}")
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return ""
        data: bytes = reader.read(size + 2)  # type: ignore[attr-defined]
        return data[:-2].decode()
    raise OSError(f"redis: unexpected reply {line[:40]!r}")


__all__: Sequence[str] = ["NatsCluster", "RedisCluster"]
