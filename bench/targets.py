"""What the benchmark measures against, each started as child processes.

``direct`` (the fake backend, the floor), ``tidegate`` (nats-server,
redis-server, edge, dispatcher, one worker on the fake), ``proxy``
(:mod:`bench.baseline_proxy`), ``fastapi`` (:mod:`bench.fastapi_proxy`, with the
``peers`` extra) and ``litellm`` (when importable). Scenario (t) starts further
tidegate stacks one at a time, and an OTLP receiver.

Invariants: everything binds 127.0.0.1 on free ports; :class:`Targets` owns every
child and :meth:`Targets.close` stops them all; every child also dies with the
benchmark process (the parent-death signal of
:class:`~fleet.run.servers.ManagedProcess`).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import secrets
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.loadgen import Endpoint
from fleet.run.nats_sync import SYNC_ALWAYS
from fleet.run.servers import (
    ManagedProcess,
    NatsServer,
    RedisServer,
    free_port,
    http_ok,
    stop_all,
)
from tidegate import config as tgconfig
from tidegate.errors import TidegateError

__all__ = ["BENCH_KEY", "MODEL", "TRANSLATED", "Target", "Targets"]

MODEL = "fake-model"
# The same fake model with POST /v1/messages translated to chat (scenario r);
# MODEL itself passes Messages through ("auto": the fake serves /v1/messages).
TRANSLATED = MODEL + "-translated"
BENCH_KEY = "sk-tg-bench-key"
_HOST = "127.0.0.1"
NATS_GOMAXPROCS = 1  # the benchmarked nats-server's GOMAXPROCS (see start_tidegate)


@dataclass(slots=True)
class Target:
    """One thing to send load to.

    ``cpu`` names the processes whose CPU counts as the gateway's (for
    tidegate: every tier and nats-server); ``memory`` the processes whose RSS
    the memory scenarios watch.
    """

    name: str
    endpoint: Endpoint
    port: int
    cpu: dict[str, ManagedProcess] = field(default_factory=dict)
    memory: dict[str, ManagedProcess] = field(default_factory=dict)
    extra: dict[str, ManagedProcess] = field(default_factory=dict)  # measured, not summed
    metrics_port: int = 0  # tidegate's edge: where it serves /metrics (0: not tidegate)

    def pids(self, group: dict[str, ManagedProcess]) -> dict[str, int]:
        return {name: p.pid for name, p in group.items() if p.pid is not None}


def _python(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def _wait(what: str, probe: Callable[[], bool], procs: list[ManagedProcess],
          timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise TidegateError(p.describe_failure(f"{p.name} exited while {what}"))
        if probe():
            return
        time.sleep(0.1)
    raise TidegateError(f"timed out after {timeout:g}s {what}\n"
                        + "\n".join(p.describe_failure(p.name) for p in procs))


class Targets:
    """The fake backend plus the targets, started on demand, stopped together."""

    def __init__(self, workdir: Path, *, heartbeat_interval: float | None = None,
                 max_streams: int | None = None,
                 overrides: Mapping[str, Any] | None = None) -> None:
        self.workdir = workdir
        self.overrides = dict(overrides or {})
        self.translated_model = False  # also serve TRANSLATED (scenario r asks)
        self.logs = workdir / "logs"
        # Logs are opened for appending: drop the previous run's.
        for old in self.logs.glob("*.log"):
            old.unlink()
        self.heartbeat_interval = heartbeat_interval
        self.max_streams = max_streams
        self._tmp = Path(tempfile.mkdtemp(prefix="tidegate-bench-"))
        self._procs: list[ManagedProcess] = []
        self.fake: ManagedProcess | None = None
        self.fake_url = ""
        self.control_url = ""
        self.available: dict[str, Target] = {}
        self._stacks: dict[str, list[ManagedProcess]] = {}  # target name -> its processes
        self.notes: list[str] = []

    def _proc(self, name: str, argv: list[str], ready: Callable[[], bool] | None = None,
              env: Mapping[str, str] | None = None) -> ManagedProcess:
        p = ManagedProcess(name, argv, self.logs / f"{name}.log", ready=ready,
                           start_timeout=30.0, env=env)
        self._procs.append(p)
        return p

    # -- the backend -------------------------------------------------------

    def start_fake(self, *options: str) -> Target:
        """The fake backend, with ``bench.fake_server``'s ``options`` if any."""
        port, control = free_port(_HOST), free_port(_HOST)
        self.control_url = f"http://{_HOST}:{control}"
        self.fake = self._proc(
            "fake-backend",
            _python("bench.fake_server", "--host", _HOST, "--port", str(port),
                    "--control-port", str(control), *options),
            ready=lambda: http_ok(f"{self.control_url}/healthz"))
        self.fake.start()
        self.fake_url = f"http://{_HOST}:{port}/v1"
        target = Target("direct", Endpoint("direct", self.fake_url, MODEL), port)
        target.extra["backend"] = self.fake
        self.available["direct"] = target
        return target

    def records(self, since: int = 0) -> list[dict[str, Any]]:
        """The fake's per-request records with an id above ``since``."""
        with urllib.request.urlopen(f"{self.control_url}/records?since={since}",
                                    timeout=30) as resp:
            data = json.load(resp)
        names = data["fields"]
        return [dict(zip(names, row, strict=True)) for row in data["records"]]

    def last_record_id(self) -> int:
        rows = self.records()
        return max((r["id"] for r in rows), default=0)

    def _with_backend(self, target: Target) -> Target:
        assert self.fake is not None
        target.extra["backend"] = self.fake
        self.available[target.name] = target
        return target

    # -- the plain proxy ---------------------------------------------------

    def start_proxy(self) -> Target:
        port = free_port(_HOST)
        proc = self._proc(
            "proxy",
            _python("bench.baseline_proxy", "--host", _HOST, "--port", str(port),
                    "--upstream", self.fake_url),
            ready=lambda: http_ok(f"http://{_HOST}:{port}/healthz"))
        proc.start()
        endpoint = Endpoint("proxy", f"http://{_HOST}:{port}/v1", MODEL)
        return self._with_backend(Target("proxy", endpoint, port, cpu={"proxy": proc},
                                         memory={"proxy": proc}))

    # -- the design's floor ------------------------------------------------

    def start_floor(self) -> Target:
        """:mod:`bench.floor` on its own nats-server, set up as tidegate's is
        (one Go thread, the shipped fsync policy): the same shape with none of
        the features, so tidegate over it is the feature tax."""
        sync = os.environ.get("TIDEGATE_BENCH_NATS_SYNC", SYNC_ALWAYS)
        nats = NatsServer(self._tmp / "floor-nats", host=_HOST,
                          log_path=self.logs / "floor-nats-server.log",
                          gomaxprocs=NATS_GOMAXPROCS,
                          sync_interval=None if sync == "none" else sync)
        self._procs.append(nats)
        nats.start()
        port = free_port(_HOST)
        edge = self._proc("floor-edge", _python("bench.floor", "edge", "--nats", nats.url,
                                                "--host", _HOST, "--port", str(port)),
                          ready=lambda: http_ok(f"http://{_HOST}:{port}/healthz"))
        edge.start()
        worker = self._proc("floor-worker", _python("bench.floor", "worker", "--nats", nats.url,
                                                    "--upstream", self.fake_url))
        worker.spawn()
        endpoint = Endpoint("floor", f"http://{_HOST}:{port}/v1", MODEL)
        _wait("waiting for a first request through the floor",
              lambda: _round_trip(endpoint), [nats, edge, worker], 30)
        return self._with_backend(Target("floor", endpoint, port,
                                         cpu={"edge": edge, "worker": worker,
                                              "nats-server": nats},
                                         memory={"edge": edge, "worker": worker}))

    # -- the seed articles' FastAPI + httpx proxy ------------------------------

    def start_fastapi(self) -> Target | None:
        """:mod:`bench.fastapi_proxy`, if fastapi, httpx and uvicorn import."""
        missing = [m for m in ("fastapi", "httpx", "uvicorn")
                   if importlib.util.find_spec(m) is None]
        if missing:
            self.notes.append(f"FastAPI proxy: skipped, {', '.join(missing)} not importable "
                              "here (pip install -e '.[peers]' to include it).")
            return None
        port = free_port(_HOST)
        proc = self._proc(
            "fastapi",
            _python("bench.fastapi_proxy", "--host", _HOST, "--port", str(port),
                    "--upstream", self.fake_url),
            ready=lambda: http_ok(f"http://{_HOST}:{port}/healthz"))
        try:
            proc.start()
        except TidegateError as exc:
            self.notes.append(f"FastAPI proxy: failed to start, skipped: {str(exc)[:300]}")
            return None
        endpoint = Endpoint("fastapi", f"http://{_HOST}:{port}/v1", MODEL)
        return self._with_backend(Target("fastapi", endpoint, port, cpu={"fastapi": proc},
                                         memory={"fastapi": proc}))

    # -- tidegate ----------------------------------------------------------

    def start_tidegate(self, name: str = "tidegate", env: Mapping[str, str] | None = None,
                       *, heartbeat_interval: float | None = None,
                       max_streams: int | None = None,
                       settings: Mapping[str, Any] | None = None,
                       nats_max_payload: int | None = None) -> Target:
        """A whole tidegate stack (its own nats-server and redis-server too).

        Its config is tidegate's default with only the backend given (what a
        user judges tidegate by), except what is pinned here or in the
        constructor (None: the default, ``max_streams = "auto"`` and the
        default heartbeat), this stack's own ``settings`` (dotted keys, as
        ``--set`` takes them) and the ``--set`` overrides on top.

        ``env`` is the tiers' complete environment (None: inherit the
        benchmark's); the servers always inherit. ``nats_max_payload``: the
        stack's nats-server's (None: its default, 1 MiB). Several stacks can run at
        once, each on its own ports; logs and config of a stack other than
        ``tidegate`` carry its name as a prefix.
        """
        heartbeat_interval = heartbeat_interval or self.heartbeat_interval
        max_streams = max_streams or self.max_streams
        prefix = "" if name == "tidegate" else f"{name}-"
        # One Go thread for nats-server: the machine's cores are shared with
        # the load generator, the backend and three Python tiers, and a second
        # P mostly spins looking for work (docs/benchmarks.md, "nats-server").
        # TIDEGATE_BENCH_NATS_SYNC: JetStream's sync_interval for the
        # stack's nats-server ("always", the shipped default; "none" leaves
        # nats-server's own), to measure what the fsync costs.
        sync = os.environ.get("TIDEGATE_BENCH_NATS_SYNC", SYNC_ALWAYS)
        extra: list[str] = []
        if nats_max_payload is not None:
            conf = self._tmp / f"{prefix}nats-payload.conf"
            conf.write_text(f"max_payload: {nats_max_payload}\n")
            extra = ["-c", str(conf)]
        nats = NatsServer(self._tmp / f"{prefix}nats", host=_HOST,
                          log_path=self.logs / f"{prefix}nats-server.log",
                          gomaxprocs=NATS_GOMAXPROCS,
                          sync_interval=None if sync == "none" else sync, extra_args=extra)
        if not prefix:
            self.notes.append(f"nats-server runs with GOMAXPROCS={NATS_GOMAXPROCS}.")
        self._procs.append(nats)
        redis = RedisServer(self._tmp / f"{prefix}redis", host=_HOST,
                            log_path=self.logs / f"{prefix}redis-server.log")
        self._procs.append(redis)
        nats.spawn()
        redis.spawn()
        nats.wait_ready()
        redis.wait_ready()
        port, metrics_port = free_port(_HOST), free_port(_HOST)
        raw: dict[str, Any] = {
            "nats": {"url": nats.url},
            "redis": {"url": redis.url},
            # Every bench client comes from 127.0.0.1: the per-address cap
            # (1,000, against one hostile client) would refuse the 2,000- and
            # 10,000-stream loads, which stand for that many users.
            "edge": {"host": _HOST, "port": port, "max_connections_per_ip": 0,
                     "metrics_port": metrics_port},
            "auth": {"dev_key": BENCH_KEY},
            "models": [{"name": MODEL, "backend": "openai", "base_url": self.fake_url}],
        }
        if self.translated_model:
            raw["models"].append({"name": TRANSLATED, "backend": "openai",
                                  "base_url": self.fake_url, "upstream_model": MODEL,
                                  "messages": "translate"})
        if heartbeat_interval is not None:
            # A short heartbeat so (b) sees heartbeats flow; the edge's
            # worker-lost limit stays above the worker's default ack_wait.
            raw["session"] = {"heartbeat_interval": heartbeat_interval,
                              "worker_lost_after": max(3, math.ceil(40 / heartbeat_interval))}
        if max_streams is not None:
            raw["models"][0]["max_streams"] = max_streams
        for dotted, value in {**(settings or {}), **self.overrides}.items():
            section, _, key = dotted.rpartition(".")
            parts = section.split(".")
            node = raw
            if parts[0] == "models":  # models.max_streams=auto: the bench's one model
                node, parts = raw["models"][0], parts[1:]
            for part in filter(None, parts):
                node = node.setdefault(part, {})
            node[key] = value
        config = tgconfig.from_dict(raw)
        path = self.workdir / f"{prefix}tidegate.toml"
        path.write_text(tgconfig.dump_toml(config))
        tiers = {tier: self._proc(f"{prefix}{tier}",
                                  _python("fleet", tier, "--config", str(path)), env=env)
                 for tier in ("dispatcher", "worker", "edge")}
        self._stacks[name] = [nats, redis, *tiers.values()]
        for p in tiers.values():
            p.spawn()
        base = f"http://{_HOST}:{port}"
        procs = [nats, redis, *tiers.values()]
        _wait("waiting for the edge to be ready", lambda: http_ok(f"{base}/readyz"), procs, 30)
        endpoint = Endpoint(name, f"{base}/v1", MODEL,
                            {"Authorization": f"Bearer {BENCH_KEY}"})
        _wait("waiting for a first request through tidegate",
              lambda: _round_trip(endpoint), procs, 30)
        target = Target(name, endpoint, port,
                        cpu={"edge": tiers["edge"], "dispatcher": tiers["dispatcher"],
                             "worker": tiers["worker"], "nats-server": nats},
                        memory={"edge": tiers["edge"], "worker": tiers["worker"]},
                        metrics_port=config.edge.metrics_port)
        target.extra["redis-server"] = redis
        return self._with_backend(target)

    def stop_stack(self, name: str) -> None:
        """Stop a tidegate stack started by :meth:`start_tidegate`: the tiers
        (SIGTERM, so they flush their telemetry), then its servers."""
        procs = self._stacks.pop(name, [])
        servers = [p for p in procs if isinstance(p, NatsServer | RedisServer)]
        stop_all([p for p in procs if p not in servers], 10.0)
        stop_all(servers, 10.0)
        self._procs = [p for p in self._procs if p not in procs]
        self.available.pop(name, None)

    # -- an OTLP receiver (scenario t) -------------------------------------

    def start_otlp_sink(self, keep: bool = False) -> tuple[ManagedProcess, str]:
        """``python -m bench.otlp_sink`` on a free port: the process and its
        URL; ``keep``: it keeps the spans (``bench.hops``)."""
        port = free_port(_HOST)
        url = f"http://{_HOST}:{port}"
        proc = self._proc("otlp-sink", _python("bench.otlp_sink", "--host", _HOST,
                                               "--port", str(port),
                                               *(["--keep"] if keep else [])),
                          ready=lambda: http_ok(f"{url}/stats"))
        proc.start()
        return proc, url

    # -- LiteLLM -----------------------------------------------------------

    def start_litellm(self) -> Target | None:
        """LiteLLM's proxy in front of the fake, if ``litellm`` is importable."""
        if importlib.util.find_spec("litellm") is None:
            self.notes.append("LiteLLM: skipped, `litellm` is not importable here "
                              "(pip install 'litellm[proxy]' to include it).")
            return None
        port = free_port(_HOST)
        cfg = self.workdir / "litellm.yaml"
        # Recent LiteLLM refuses to start without a master key (every request
        # would be unauthenticated); the bench's clients send this one.
        master_key = f"sk-{secrets.token_hex(32)}"
        # JSON is valid YAML; no yaml writer needed.
        cfg.write_text(json.dumps({
            "model_list": [{"model_name": MODEL, "litellm_params": {
                "model": f"openai/{MODEL}", "api_base": self.fake_url, "api_key": "sk-fake"}}],
            "general_settings": {"master_key": master_key}}))
        # The bundled cost map, not a fetch from GitHub at every start (this
        # machine may have no route out, and the retries take seconds).
        env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
        proc = self._proc("litellm", _python("litellm.proxy.proxy_cli", "--host", _HOST,
                                             "--port", str(port), "--config", str(cfg)),
                          ready=lambda: http_ok(f"http://{_HOST}:{port}/health/liveliness"),
                          env=env)
        try:
            proc.start(timeout=60)
        except TidegateError as exc:
            self.notes.append(f"LiteLLM: failed to start, skipped: {str(exc)[:300]}")
            return None
        endpoint = Endpoint("litellm", f"http://{_HOST}:{port}/v1", MODEL,
                            {"Authorization": f"Bearer {master_key}"})
        return self._with_backend(Target("litellm", endpoint, port, cpu={"litellm": proc},
                                         memory={"litellm": proc}))

    # -- teardown ----------------------------------------------------------

    def close(self) -> None:
        """Stop every child (edge first, servers last), then remove scratch state."""
        order = sorted(self._procs, key=lambda p: p.name in ("nats-server", "redis-server"))
        try:
            stop_all([p for p in order if p.name not in ("nats-server", "redis-server")], 10.0)
            stop_all([p for p in order if p.name in ("nats-server", "redis-server")], 10.0)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> Targets:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _round_trip(endpoint: Endpoint) -> bool:
    body = json.dumps({"model": endpoint.model, "max_tokens": 1, "fake_ttft": 0,
                       "messages": [{"role": "user", "content": "ping"}]}).encode()
    req = urllib.request.Request(endpoint.chat_url, data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **endpoint.headers})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return int(resp.status) == 200
    except OSError:
        return False
