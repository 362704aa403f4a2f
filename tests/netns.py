"""A fleet across hosts: every process in its own network namespace, on one bridge.

Each "host" is a network namespace with one veth pair: ``eth0`` inside (its
own address on a /24), the other end on a bridge in the root namespace, which
holds the subnet's ``.1`` (so the test process, in the root namespace, reaches
every host the way a client or a probe would). Processes run under ``ip netns
exec``, which execs the command, so the pid we hold is the process itself.

Links are cut by routes, not by firewall rules (this box has neither iptables
nor nft, and tc has no classifiers or netem):

* :meth:`Net.cut` ``(a, b)``: a blackhole route to ``b`` in ``a`` and to ``a``
  in ``b``: packets vanish silently both ways, as in a real partition (no RST,
  no ICMP), so TCP connections stay "up" until a keepalive/ping notices;
* :meth:`Net.cut_oneway` ``(src, dst)``: only ``src`` -> ``dst`` vanishes; the
  asymmetric cut "the worker can send but not receive" is every NATS node
  unable to send to the worker;
* :meth:`Net.slow`: a token bucket (``tc tbf``) on both ends of a host's veth:
  a narrow link whose queue adds delay and drops the tail (netem, for a
  fixed delay and random loss, is not in this kernel);
* :meth:`Net.heal` removes every cut and shaping at once.

Invariants:

* Names are unique per :class:`Net` (a random id in every namespace, bridge
  and veth name), so parallel test workers never collide; the subnet is one
  no interface of the box already uses.
* :meth:`Net.close` removes every namespace and the bridge (deleting a
  namespace deletes its veth and with it the bridge port), also after a
  failure; the processes die first (they are killed by pid, and with their
  parent by ``PR_SET_PDEATHSIG``).
* :func:`unavailable` says why namespaces cannot be made here (not root, no
  ``ip``, no veth/bridge support); the tests skip with that reason.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fleet.run.servers import (
    ManagedProcess,
    NatsServer,
    RedisServer,
    http_ok,
    stop_all,
)
from tidegate import config as tgconfig
from tidegate.config import Config

NATS_PORT, NATS_ROUTE_PORT, NATS_MONITOR_PORT = 4222, 6222, 8222
REDIS_PORT = 6379
EDGE_PORT = 8080
DEV_KEY = "sk-tg-netns-key"
MODEL = "tidegate-sim"


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str:
    """Why network namespaces cannot be made here ('' when they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    if shutil.which("ip") is None:
        return "no `ip` (iproute2) on PATH"
    probe = f"tgp{os.getpid() % 100000}{random.randrange(1000)}"
    try:
        _run("ip", "netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"ip netns add failed: {getattr(exc, 'stderr', exc)!s}".strip()
    try:
        _run("ip", "link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b")
        _run("ip", "link", "del", f"{probe}a")
        _run("ip", "link", "add", f"{probe}br", "type", "bridge")
        _run("ip", "link", "del", f"{probe}br")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"no veth/bridge support: {getattr(exc, 'stderr', exc)!s}".strip()
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return ""


def _free_subnet() -> str:
    """A 10.x.y.0/24 prefix ("10.x.y") that no interface here uses."""
    used = _run("ip", "-o", "-4", "addr", "show").stdout + _run("ip", "-4", "route").stdout
    rng = random.Random()
    for _ in range(200):
        prefix = f"10.{rng.randrange(100, 250)}.{rng.randrange(0, 255)}"
        if f" {prefix}." not in used and f"\n{prefix}." not in "\n" + used:
            return prefix
    raise RuntimeError("no free 10.x.y.0/24 subnet for the namespaces")


@dataclass(slots=True)
class Host:
    """One network namespace with one address."""

    name: str  # logical: nats-1, edge-2...
    ns: str
    ip: str
    veth: str  # the root-namespace end, on the bridge

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.ns, *command]

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return _run(*self.argv(command), check=check)


class Net:
    """A bridge and its hosts; links cut and healed by routes (see module doc)."""

    def __init__(self) -> None:
        self.id = f"{os.getpid() % 1000:03d}{random.randrange(36 ** 2):03d}"[-5:]
        self.bridge = f"tgb{self.id}"
        self.prefix = _free_subnet()
        self.hosts: dict[str, Host] = {}
        self.cuts: set[tuple[str, str]] = set()  # (host, blackholed host)
        self.shaped: set[str] = set()
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.prefix}.1/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add(self, name: str) -> Host:
        """A new namespace on the bridge, with the next address."""
        n = len(self.hosts) + 2
        host = Host(name, f"tg-{self.id}-{name}", f"{self.prefix}.{n}", f"tgv{self.id}{n:02d}")
        self.hosts[name] = host  # recorded before it exists: close() removes half-made ones
        peer = f"tgp{self.id}{n:02d}"
        _run("ip", "netns", "add", host.ns)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", peer)
        _run("ip", "link", "set", peer, "netns", host.ns)
        _run("ip", "link", "set", host.veth, "master", self.bridge)
        _run("ip", "link", "set", host.veth, "up")
        host.run("ip", "link", "set", peer, "name", "eth0")
        host.run("ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
        host.run("ip", "link", "set", "eth0", "up")
        host.run("ip", "link", "set", "lo", "up")
        return host

    # -- faults -----------------------------------------------------------------

    def cut_oneway(self, src: str, dst: str) -> None:
        """Packets from ``src`` to ``dst`` vanish (a blackhole route in ``src``)."""
        if (src, dst) in self.cuts:
            return
        self.hosts[src].run("ip", "route", "add", "blackhole", f"{self.hosts[dst].ip}/32")
        self.cuts.add((src, dst))

    @property
    def gateway(self) -> str:
        """The root namespace's address on the bridge."""
        return f"{self.prefix}.1"

    def cut(self, a: str, b: str) -> None:
        """No packet between ``a`` and ``b``, either way."""
        self.cut_oneway(a, b)
        self.cut_oneway(b, a)

    def isolate(self, name: str, from_: Sequence[str]) -> None:
        """Cut ``name`` from each of ``from_`` (both ways)."""
        for other in from_:
            self.cut(name, other)

    def slow(self, name: str, rate: str = "256kbit", latency: str = "200ms") -> None:
        """A narrow link for ``name``, both directions: a token bucket
        (queueing delay up to ``latency``, tail drop beyond it). netem is not
        in this kernel (``tc qdisc add ... netem`` says "unknown")."""
        host = self.hosts[name]
        shape = ["root", "tbf", "rate", rate, "burst", "4kb", "latency", latency]
        host.run("tc", "qdisc", "replace", "dev", "eth0", *shape)
        _run("tc", "qdisc", "replace", "dev", host.veth, *shape)
        self.shaped.add(name)

    def heal(self) -> None:
        """Every cut and every shaped link back to normal."""
        for src, dst in sorted(self.cuts):
            self.hosts[src].run("ip", "route", "del", "blackhole", f"{self.hosts[dst].ip}/32",
                                check=False)
        self.cuts.clear()
        for name in sorted(self.shaped):
            host = self.hosts[name]
            host.run("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
            _run("tc", "qdisc", "del", "dev", host.veth, "root", check=False)
        self.shaped.clear()

    def close(self) -> None:
        """Remove every namespace and the bridge (idempotent, never raises)."""
        for host in self.hosts.values():
            _run("ip", "netns", "del", host.ns, check=False)
            _run("ip", "link", "del", host.veth, check=False)
        self.hosts.clear()
        _run("ip", "link", "del", self.bridge, check=False)


# --------------------------------------------------------------------------
# The fleet
# --------------------------------------------------------------------------


@dataclass
class HostFleet:
    """3 NATS nodes, Redis, 2 edges, 2 dispatchers, 2 workers: one host each.

    Every tier is given every NATS node's address (``nats.url``), Redis's,
    and talks to nothing on 127.0.0.1: a cut between two hosts is a cut
    between those processes. The edges listen on their host's address
    (:attr:`edge_urls`); a client picks one, and resumes on any.
    """

    workdir: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    tiers: dict[str, int] = field(default_factory=lambda: {
        "dispatcher": 2, "worker": 2, "edge": 2})
    # The [[models]] given the bridge's address in the root namespace (where a
    # test's FakeBackend listens); None: the simulator.
    models: Callable[[str], list[dict[str, Any]]] | None = None
    net: Net = field(init=False)
    nats: list[NatsServer] = field(init=False, default_factory=list)
    redis: RedisServer = field(init=False)
    procs: dict[str, ManagedProcess] = field(init=False, default_factory=dict)
    config: Config = field(init=False)

    def start(self, timeout: float = 120.0) -> None:
        """Namespaces, servers, then tiers; everything made is undone on failure."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.net = Net()
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        net = self.net
        names = ["nats-1", "nats-2", "nats-3", "redis",
                 *(f"{tier}-{i + 1}" for tier, n in self.tiers.items() for i in range(n))]
        for name in names:
            net.add(name)
        nats_hosts = [net.hosts[f"nats-{i + 1}"] for i in range(3)]
        for i, host in enumerate(nats_hosts):
            routes = ",".join(f"nats://{h.ip}:{NATS_ROUTE_PORT}" for h in nats_hosts
                              if h is not host)
            node = NatsServer(self.workdir / host.name, host=host.ip, port=NATS_PORT,
                              monitor_port=NATS_MONITOR_PORT, start_timeout=60.0,
                              extra_args=["--server_name", f"n{i + 1}", "--cluster_name",
                                          f"tg{net.id}", "--cluster",
                                          f"nats://{host.ip}:{NATS_ROUTE_PORT}",
                                          "--routes", routes])
            node.argv = host.argv(node.argv)
            node.name = host.name
            self.nats.append(node)
        rhost = net.hosts["redis"]
        # Protected mode refuses every non-loopback client of a server without
        # a password; the bridge is private to this test.
        self.redis = RedisServer(self.workdir / "redis", host=rhost.ip, port=REDIS_PORT,
                                 extra_args=["--protected-mode", "no"])
        self.redis.argv = rhost.argv(self.redis.argv)
        self.redis.name = "redis"
        raw: dict[str, Any] = {
            "nats": {"url": ",".join(f"nats://{h.ip}:{NATS_PORT}" for h in nats_hosts)},
            "redis": {"url": f"redis://{rhost.ip}:{REDIS_PORT}/0"},
            "streams": {"replicas": 3},
            "edge": {"host": "0.0.0.0", "port": EDGE_PORT, "metrics_port": 0,
                     "admission_timeout": 20.0, "queue_timeout": 30.0},
            "auth": {"dev_key": DEV_KEY},
            "session": {"heartbeat_interval": 2.0},
            "dispatcher": {"ack_wait": 2.0},
            "worker": {"ack_wait": 3.0, "shutdown_timeout": 5.0},
            # Deterministic: a stream continued on another worker (the
            # shipped failover) reads as the text the checker expects, as a
            # greedy model's would (docs/resume.md, "Continuation").
            "models": [{"name": MODEL, "max_streams": 64,
                        "simulator": {"ttft": 0.02, "tokens_per_second": 50.0,
                                      "length": 64, "deterministic": True}}],
        }
        if self.models is not None:
            raw["models"] = self.models(net.gateway)
        for section, values in self.overrides.items():
            if isinstance(values, dict):
                raw.setdefault(section, {}).update(values)
            else:
                raw[section] = values
        self.config = tgconfig.from_dict(raw)
        path = self.workdir / "tidegate.toml"
        path.write_text(tgconfig.dump_toml(self.config))
        for node in self.nats:
            node.spawn()
        self.redis.spawn()
        for tier, n in self.tiers.items():
            for i in range(n):
                host = net.hosts[f"{tier}-{i + 1}"]
                self.procs[host.name] = ManagedProcess(
                    host.name,
                    host.argv([sys.executable, "-m", "fleet", tier, "--config", str(path)]),
                    self.workdir / "logs" / f"{host.name}.log", start_timeout=60.0)
        self._wait(lambda: all(n.is_ready() for n in self.nats) and self.redis.is_ready(),
                   timeout, "NATS nodes and Redis ready")
        for proc in self.procs.values():
            proc.spawn()
        self._wait(lambda: all(http_ok(f"{u}/readyz") for u in self.edge_urls), timeout,
                   "every edge ready")

    def _wait(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.all():
                if p.poll() is not None:
                    raise RuntimeError(p.describe_failure(f"{p.name} exited"))
            if time.monotonic() > deadline:
                raise RuntimeError(f"not within {timeout:g}s: {what}")
            time.sleep(0.2)

    @property
    def edge_urls(self) -> list[str]:
        return [f"http://{self.net.hosts[n].ip}:{EDGE_PORT}"
                for n in sorted(self.net.hosts) if n.startswith("edge-")]

    @property
    def nats_names(self) -> list[str]:
        return [n.name for n in self.nats]

    def meta_leader(self) -> str:
        """The JetStream meta leader's host name (nats-N), '' while none."""
        for host in self.nats_names:
            ip = self.net.hosts[host].ip
            try:
                with urllib.request.urlopen(f"http://{ip}:{NATS_MONITOR_PORT}/jsz",
                                            timeout=1.0) as resp:
                    doc = json.loads(resp.read())
            except (OSError, ValueError):
                continue
            leader = (doc.get("meta_cluster") or {}).get("leader") or ""
            if leader:
                return f"nats-{str(leader).removeprefix('n')}"
        return ""

    def all(self) -> list[ManagedProcess]:
        return [*self.nats, *([self.redis] if hasattr(self, "redis") else []),
                *self.procs.values()]

    def stop(self) -> None:
        """Every process, then every namespace (never raises)."""
        try:
            stop_all(list(self.procs.values()), 10.0)
            stop_all([*self.nats, *([self.redis] if hasattr(self, "redis") else [])], 10.0)
        finally:
            if hasattr(self, "net"):
                self.net.heal()
                self.net.close()
