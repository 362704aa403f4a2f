"""The fleet ``tidegate chaos`` runs (:class:`Fleet`): 3 JetStream nodes (R3
streams, every tier given all three URLs), one Redis, 2 dispatchers, 2 workers
serving the simulator (or fake backend replicas) and 2 edges sharing one port
(``SO_REUSEPORT``), each a process a supervisor restarts. With ``defaults`` its
config names only what a deployment must (docs/reliability.md, the defaults bar).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from fleet.run.clusters import NatsCluster
from fleet.run.servers import ManagedProcess, RedisServer, free_port, http_ok, stop_all
from fleet.run.supervisor import RestartPolicy, Supervisor
from tidegate import config as tgconfig
from tidegate.errors import TidegateError

DEV_KEY = "sk-tg-chaos-key"
MODEL = "tidegate-sim"


class Fleet:
    """3 NATS nodes, Redis, and N edges / dispatchers / workers as processes."""

    def __init__(self, workdir: Path, edges: int = 2, dispatchers: int = 2, workers: int = 2,
                 overrides: dict[str, Any] | None = None, backends: int = 0,
                 defaults: bool = False) -> None:
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.nats = NatsCluster(workdir / "nats")
        self.redis = RedisServer(workdir / "redis")
        self.redis.name = "redis"
        self.port = free_port()
        self.failure: str | None = None  # why the supervisor gave up (supervise)
        # With ``backends``: the model is served by that many replicas of the
        # bench's fake OpenAI server, each a process of its own, in its
        # deterministic mode (the simulator's text, from the same
        # workers.backends.greedy), instead of the in-worker simulator.
        self.backend_urls = [f"http://127.0.0.1:{free_port()}" for _ in range(backends)]
        self.backends = [self._backend(i, url) for i, url in enumerate(self.backend_urls)]
        raw: dict[str, Any] = {
            "nats": {"url": self.nats.url},
            "redis": {"url": self.redis.url},
            "streams": {"replicas": 3},
            # Several edges on one port: no shared metrics port (none scraped
            # here). admission_timeout at its default: half of it caps the
            # publish patience, which must outlast a leader's election (4-9 s).
            "edge": {"port": self.port, "reuse_port": True, "metrics_port": 0,
                     "admission_timeout": 30.0, "queue_timeout": 30.0},
            "auth": {"dev_key": DEV_KEY},
            "session": {"heartbeat_interval": 2.0},
            "dispatcher": {"ack_wait": 2.0},
            "worker": {"ack_wait": 3.0, "shutdown_timeout": 5.0},
            # failover = "continue": a stream whose worker dies goes on on
            # another one (docs/resume.md, "Continuation"); the deterministic
            # simulator continues a delivered prefix as a greedy model would,
            # so the continued text must still be exactly the expected one.
            "models": [{"name": MODEL, "max_streams": 64, "failover": "continue",
                        "simulator": {"ttft": 0.02, "tokens_per_second": 200.0,
                                      "length": 32, "deterministic": True}}],
        }
        if defaults:  # only what a deployment must name (see the module docstring)
            for section in ("session", "dispatcher", "worker"):
                del raw[section]
            del raw["models"][0]["failover"]
            raw["edge"] = {k: raw["edge"][k] for k in ("port", "reuse_port", "metrics_port")}
        if self.backends:
            raw["models"][0].update(backend="openai",
                                    base_urls=[f"{u}/v1" for u in self.backend_urls])
        for section, values in (overrides or {}).items():
            raw.setdefault(section, {}).update(values)
        self.config = tgconfig.from_dict(raw)
        self.config_path = workdir / "tidegate.toml"
        self.config_path.write_text(tgconfig.dump_toml(self.config))
        # Restarts whatever dies, the killed processes and any other: as
        # `tidegate up` or Kubernetes would. Exits beyond the kills are crashes.
        self.supervisor = Supervisor(
            RestartPolicy(backoff_initial=0.5, backoff_max=2.0, crash_limit=1000),
            workdir / "processes.json", lambda p: p.wait_ready(60.0))
        self.tiers: dict[str, list[ManagedProcess]] = {
            "dispatcher": [self._tier("dispatcher", i) for i in range(dispatchers)],
            "worker": [self._tier("worker", i) for i in range(workers)],
            "edge": [self._tier("edge", i) for i in range(edges)],
        }

    def _backend(self, i: int, url: str) -> ManagedProcess:
        return ManagedProcess(
            f"backend-{i + 1}",
            [sys.executable, "-m", "bench.fake_backend", "--port", url.rsplit(":", 1)[1],
             "--deterministic", "--ttft", "0.02", "--itl", "0.005", "--tokens", "32",
             "--model", MODEL],
            self.workdir / "logs" / f"backend-{i + 1}.log", start_timeout=60.0,
            ready=lambda: http_ok(f"{url}/v1/models"))

    def _tier(self, tier: str, i: int) -> ManagedProcess:
        name = f"{tier}-{i + 1}"
        return ManagedProcess(name, [sys.executable, "-m", "fleet", tier, "--config",
                                     str(self.config_path)],
                              self.workdir / "logs" / f"{name}.log", start_timeout=60.0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self, kind: str) -> list[ManagedProcess]:
        if kind == "nats":
            return list(self.nats.nodes)
        if kind == "redis":
            return [self.redis]
        if kind == "backend":
            return self.backends
        return self.tiers[kind]

    def start(self, timeout: float = 90.0) -> None:
        try:
            self.nats.start()
            self.redis.start()
            for b in self.backends:
                b.spawn()
                b.wait_ready(60.0)
            for procs in self.tiers.values():
                for p in procs:
                    p.spawn()
            deadline = time.monotonic() + timeout
            while not http_ok(f"{self.url}/readyz"):
                for p in self.all():
                    if p.poll() is not None:
                        raise RuntimeError(p.describe_failure(f"{p.name} exited"))
                if time.monotonic() > deadline:
                    raise RuntimeError(f"fleet not ready within {timeout:g}s")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise
        for p in self.all():
            self.supervisor.add(p, server=p in self.nats.nodes or p is self.redis
                                or p in self.backends)

    def supervise(self, stop: threading.Event) -> None:
        """Restart dead processes until ``stop`` (run in a thread); one it
        cannot restart ends the run (``failure``: the killer stops waiting)."""
        while not stop.wait(0.1):
            failure = self.supervisor.tick()
            if failure is not None:
                self.failure = failure
                raise TidegateError(failure)

    def restarts(self) -> dict[str, int]:
        return {name: s.restarts for name, s in self.supervisor.states.items() if s.restarts}

    def all(self) -> list[ManagedProcess]:
        return [*self.nats.nodes, self.redis, *self.backends,
                *(p for ps in self.tiers.values() for p in ps)]

    def stop(self) -> None:
        stop_all([p for ps in reversed(list(self.tiers.values())) for p in ps], 15.0)
        stop_all([self.redis, *self.backends], 10.0)
        self.nats.stop()
