"""The whole pipeline as real processes, for tests.

:class:`Pipeline` writes a config file and runs ``python -m fleet edge``,
``dispatcher`` and ``worker`` against a real nats-server and redis-server that
the test suite started itself. Fault tests kill and restart single tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import nats
import nats.js.errors
from aiohttp import web

from bench.fake_backend import FakeBackend, FakeRecord
from fleet.run.servers import ManagedProcess, free_port, http_ok, stop_all
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.control.keys import create_key, ensure_keys_bucket
from tidegate.telemetry.observability import METRICS_PORT_ENV
from tidegate.wire.protocol import UsageRecord

DEV_KEY = "sk-test-pipeline-key"


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


class Pipeline:
    """Edge, dispatcher and worker(s) as child processes.

    ``env`` is added to the children's environment (OTel variables, say).
    With ``metrics``, the dispatcher and each worker serve ``/metrics`` on a
    port of their own (:meth:`metrics_url`); every edge always does, on a port
    of its own too (``edge.metrics_port``; never its API port, where it would
    need no key). With ``workers=0``, :meth:`start` waits for the edge only.
    """

    def __init__(self, workdir: Path, nats_url: str, redis_url: str,
                 overrides: Mapping[str, Any] | None = None, workers: int = 1,
                 env: Mapping[str, str] | None = None, metrics: bool = False,
                 edges: int = 1, worker_env: Sequence[Mapping[str, str]] = (),
                 worker_launcher: Sequence[str] = ("fleet",),
                 edge_env: Mapping[str, str] | None = None) -> None:
        self.workdir = workdir
        self.env = dict(env) if env else None
        self.metrics = metrics
        self.metrics_ports: dict[str, int] = {}
        self._given: set[int] = set()
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = self._free_port()
        self.metrics_ports["edge"] = self._free_port()
        raw: dict[str, Any] = {
            "nats": {"url": nats_url},
            "redis": {"url": redis_url},
            # admission_timeout as the default (30 s): half of it caps the
            # edge's publish patience, which must outlast a JetStream leader's
            # election after a NATS node's death (4-9 s) on a busy machine;
            # at 20 s the cap was 10 s, and a cluster test got 503s.
            "edge": {"port": self.port, "admission_timeout": 30.0, "queue_timeout": 60.0,
                     "metrics_port": self.metrics_ports["edge"]},
            "auth": {"dev_key": DEV_KEY},
            "session": {"heartbeat_interval": 2.0},
            "dispatcher": {"ack_wait": 2.0},
            "worker": {"ack_wait": 3.0, "shutdown_timeout": 5.0},
            "models": [{"name": "tidegate-sim", "aliases": ["sim"],
                        "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}}],
        }
        _merge(raw, overrides or {})
        self.config = tgconfig.from_dict(raw)
        self.config_path = workdir / "tidegate.toml"
        self.config_path.write_text(tgconfig.dump_toml(self.config))
        self.dispatcher = self._process("dispatcher")
        self.dispatchers = [self.dispatcher]
        # worker_env[i]: more environment for worker i only (its own config
        # overrides, e.g. TIDEGATE__WORKER__REPLICAS).
        # worker_launcher: the module (and its arguments) that runs the
        # workers, e.g. a fault wrapper from tests/faults.
        self.workers = [self._process("worker", f"worker{i}",
                                      extra_env=worker_env[i] if i < len(worker_env) else None,
                                      launcher=worker_launcher)
                        for i in range(workers)]
        # edge_env: more environment for the first edge only (its own NATS
        # URL through a proxy, say).
        self.edge = self._process("edge", ready=lambda: http_ok(f"{self.url}/readyz"),
                                  extra_env=edge_env)
        # More edges (``edges`` > 1), each on a port of its own: edge_urls[i].
        self.edge_ports = [self.port] + [self._free_port() for _ in range(edges - 1)]
        self.extra_edges = [self._edge(i) for i in range(1, edges)]

    def _edge(self, i: int) -> ManagedProcess:
        url = f"http://127.0.0.1:{self.edge_ports[i]}"
        metrics = self.metrics_ports[f"edge{i}"] = self._free_port()
        return self._process("edge", f"edge{i}", ready=lambda: http_ok(f"{url}/readyz"),
                             args=["--port", str(self.edge_ports[i])],
                             extra_env={METRICS_PORT_ENV: str(metrics)})

    def _free_port(self) -> int:
        """A free port none of this pipeline's processes got yet: the OS may
        hand out a port released a moment ago again, and a port is only
        taken once its process starts (an edge's API port and another's
        metrics port came out equal once)."""
        while True:
            port = free_port()
            if port not in self._given:
                self._given.add(port)
                return port

    @property
    def edges(self) -> list[ManagedProcess]:
        return [self.edge, *self.extra_edges]

    @property
    def edge_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.edge_ports]

    def _process(self, tier: str, name: str | None = None,
                 ready: Any = None, args: list[str] | None = None,
                 extra_env: Mapping[str, str] | None = None,
                 launcher: Sequence[str] = ("fleet",)) -> ManagedProcess:
        name = name or tier
        env: dict[str, str] | None = None
        if self.env or extra_env or (self.metrics and tier != "edge"):
            env = {**os.environ, **(self.env or {}), **(extra_env or {})}
            if self.metrics and tier != "edge":
                port = self.metrics_ports[name] = self._free_port()
                env[METRICS_PORT_ENV] = str(port)
        if launcher[0].startswith("tests."):  # importable wherever pytest was started
            env = env or dict(os.environ)
            root = str(Path(__file__).resolve().parent.parent)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        return ManagedProcess(
            name, [sys.executable, "-m", *launcher, tier, "--config", str(self.config_path),
                   *(args or [])],
            self.workdir / "logs" / f"{name}.log", env=env, ready=ready, start_timeout=30.0)

    def metrics_url(self, name: str) -> str:
        """Where process ``name`` (``edge``, ``dispatcher``, ``worker0``, ...)
        serves ``/metrics``."""
        return f"http://127.0.0.1:{self.metrics_ports[name]}/metrics"

    def scrape(self, name: str, timeout: float = 5.0) -> str:
        with urllib.request.urlopen(self.metrics_url(name), timeout=timeout) as resp:
            return str(resp.read().decode())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def processes(self) -> list[ManagedProcess]:
        return [self.edge, *self.extra_edges, *self.workers, *self.dispatchers]

    def setup(self) -> None:
        """``tidegate setup`` as admin, as a deployment runs it before the
        tiers: with per-tier credentials they may not create what they use."""
        done = subprocess.run(
            [sys.executable, "-m", "fleet", "setup", "--config", str(self.config_path)],
            capture_output=True, text=True, timeout=120, env={**os.environ, **(self.env or {})})
        if done.returncode != 0:
            raise RuntimeError(f"tidegate setup failed ({done.returncode}): {done.stderr}")

    def start(self) -> None:
        if self.config.nats.credentials:
            self.setup()
        for dispatcher in self.dispatchers:
            dispatcher.spawn()
        for worker in self.workers:
            worker.spawn()
        self.edge.start()
        for edge in self.extra_edges:
            edge.start()
        if self.workers:
            self.wait_serving()
            self.wait_workers()

    def wait_serving(self, timeout: float = 30.0) -> None:
        """Until one request has made the full round trip (all tiers up)."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                status, _ = self.post("/v1/chat/completions", {
                    "model": self.config.models[0].name, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "ping"}]}, timeout=10)
                if status == 200:
                    return
            except Exception as exc:
                last = exc
            time.sleep(0.2)
        raise RuntimeError(f"pipeline did not serve within {timeout}s: {last}\n"
                           + "\n".join(p.describe_failure(p.name) for p in self.processes))

    def wait_workers(self, timeout: float = 30.0) -> None:
        """Until every worker pulls jobs (its log's "worker serving"): one
        round trip proves one worker, and on a loaded box another may start
        seconds later, so a test that kills worker 0 mid-stream found it had
        run none of the streams (CI: "no stream ran on the killed worker")."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            while "worker serving" not in (worker.log_path.read_text(errors="replace")
                                           if worker.log_path.exists() else ""):
                if time.monotonic() > deadline or not worker.running:
                    raise RuntimeError(f"{worker.name} did not serve within {timeout}s\n"
                                       + worker.describe_failure(worker.name))
                time.sleep(0.1)

    def post(self, path: str, body: Any, *, key: str | None = DEV_KEY,
             timeout: float = 30.0, raw: bytes | None = None,
             headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        status, _, data = self.post_full(path, body, key=key, timeout=timeout, raw=raw,
                                         headers=headers)
        return status, data

    def post_full(self, path: str, body: Any, *, key: str | None = DEV_KEY,
                  timeout: float = 30.0, raw: bytes | None = None,
                  headers: Mapping[str, str] | None = None,
                  ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """:meth:`post` that keeps the response headers (case-insensitive
        lookups: ``headers["retry-after"]``, ``"x-request-id" in headers``)."""
        data = raw if raw is not None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method="POST")
        req.add_header("Content-Type", "application/json")
        if key is not None:
            req.add_header("Authorization", f"Bearer {key}")
        for name, value in (headers or {}).items():
            req.add_header(name, value)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.headers, resp.read()
        except urllib.error.HTTPError as err:
            return err.code, err.headers, err.read()

    def stop(self) -> None:
        stop_all(self.processes, timeout=10.0)

    def logs(self) -> str:
        """The last lines of each process's log: for a failed assertion's message."""
        return "\n".join(p.describe_failure(p.name, lines=40) for p in self.processes)

    def log_text(self) -> str:
        """Every process's whole log, to count or look for lines in: a tail
        (:meth:`logs`) drops the first of many, so a count on it undercounts."""
        return "\n".join(p.log_path.read_text(errors="replace") for p in self.processes
                         if p.log_path.exists())


def running_pipeline(workdir: Path, nats_url: str, redis_url: str,
                     **kwargs: Any) -> Iterator[Pipeline]:
    """Generator body for fixtures: start, yield, always stop."""
    pipeline = Pipeline(workdir, nats_url, redis_url, **kwargs)
    try:
        pipeline.start()
        yield pipeline
    finally:
        pipeline.stop()


def paced_simulator(slots: int, tokens_per_second: float) -> list[dict[str, Any]]:
    """The models override for ``tidegate-sim`` with ``slots`` pinned slots and a
    pace slow enough that a test can watch which jobs hold them."""
    return [{"name": "tidegate-sim", "max_streams": slots,
             "simulator": {"ttft": 0.02, "tokens_per_second": tokens_per_second,
                           "length": 4}}]


@contextlib.contextmanager
def threaded_fake_backend(**kwargs: Any) -> Iterator[FakeBackend]:
    """A FakeBackend on its own event loop thread, so sync tests, async tests
    and worker processes can all use it. Its records use ``time.monotonic()``,
    comparable with the test's own clock."""
    loop = asyncio.new_event_loop()
    backend = FakeBackend(**kwargs)
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(backend.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("fake backend did not start")
    try:
        yield backend
    finally:
        asyncio.run_coroutine_threadsafe(backend.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def record_for(backend: FakeBackend, marker: str) -> list[FakeRecord]:
    """The backend's records of requests whose messages contain ``marker``."""
    return [r for r in list(backend.records) if marker in json.dumps(r.body.get("messages"))]


async def wait_for(predicate: Any, within: float, step: float = 0.01) -> bool:
    """Poll ``predicate`` every ``step`` seconds; whether it held within ``within``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(step)
    return bool(predicate())


@contextlib.asynccontextmanager
async def fresh_streams(url: str, **sections: Any) -> AsyncIterator[
        tuple[nats.NATS, nats.js.JetStreamContext, tgconfig.Config]]:
    """A connection to the nats-server at ``url``, and tidegate's streams on
    it under a prefix of their own (config ``sections`` on top)."""
    config = tgconfig.from_dict({**sections, "nats": {
        **sections.get("nats", {}), "subject_prefix": "t" + os.urandom(4).hex()}})
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await broker.ensure_streams(js, config)
        yield nc, js, config
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on a free loopback port; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


async def usage_records(config: tgconfig.Config) -> list[UsageRecord]:
    """Every record on the pipeline's ``<P>_USAGE`` stream, oldest first (its
    retention keeps them for billing, so reading does not take them from the
    dispatchers). Read message by message: small test streams only."""
    nc = await nats.connect(config.nats.url.split(","))
    try:
        js = nc.jetstream()
        stream = config.nats.subjects.usage_stream
        try:
            state = (await js.stream_info(stream)).state
        except nats.js.errors.NotFoundError:
            return []
        out: list[UsageRecord] = []
        for seq in range(state.first_seq or 1, state.last_seq + 1):
            try:
                msg = await js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            if msg.data:
                out.append(UsageRecord.decode(msg.data))
        return out
    finally:
        await nc.close()


async def usage_of(config: tgconfig.Config, request_id: str, within: float = 15.0,
                   count: int = 1) -> list[UsageRecord]:
    """The usage records of ``request_id`` once there are ``count`` of them
    (records of a redelivered job carry a higher ``attempt``)."""
    deadline = time.monotonic() + within
    while True:
        found = [r for r in await usage_records(config) if r.id == request_id]
        if len(found) >= count or time.monotonic() >= deadline:
            assert len(found) >= count, (f"{len(found)} usage records of {request_id} "
                                         f"within {within}s, wanted {count}: {found}")
            return found
        await asyncio.sleep(0.1)


async def tenant_keys(pipeline: Pipeline, *tenants: str) -> list[str]:
    """A new API key for each of ``tenants``, made as an admin would."""
    nc = await broker.connect(pipeline.config.nats, "tidegate-admin-test")
    try:
        kv = await ensure_keys_bucket(broker.jetstream(nc, pipeline.config.nats),
                                      pipeline.config)
        return [(await create_key(kv, tenant))[0] for tenant in tenants]
    finally:
        await nc.close()


async def jobs_waiting(pipeline: Pipeline, count: int) -> bool:
    """Whether ``<P>_JOBS`` holds at least ``count`` jobs (admitted, not yet acked)."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        info = await nc.jetstream().stream_info(pipeline.config.nats.subjects.jobs_stream)
        return int(info.state.messages) >= count
    finally:
        await nc.close()


async def tombstones(pipeline: Pipeline, count: int) -> list[str]:
    """The request ids with a cancel tombstone, once there are ``count`` (else [])."""
    nc = await nats.connect(pipeline.config.nats.url)
    try:
        kv = await nc.jetstream().key_value(pipeline.config.nats.subjects.cancels_bucket)
        try:
            keys = list(await kv.keys())
        except nats.js.errors.NoKeysError:
            keys = []
        return keys if len(keys) >= count else []
    finally:
        await nc.close()


async def wait_log(process: ManagedProcess, text: str, within: float = 30.0) -> None:
    """Until ``text`` appears in the log of ``process``'s current run (the log
    file is appended to across restarts; each run starts with a marker)."""
    deadline = time.monotonic() + within
    while True:
        log = process.log_path.read_text(errors="replace") if process.log_path.exists() else ""
        if text in log.rsplit("\n--- ", 1)[-1]:
            return
        if time.monotonic() >= deadline or (process.poll() is not None):
            raise AssertionError(f"{text!r} not in {process.name}'s log within {within}s\n"
                                 + process.log_tail(30))
        await asyncio.sleep(0.05)


async def stream(session: aiohttp.ClientSession, url: str, model: str, text: str, *,
                 usage: bool = False, progress: dict[str, int] | None = None,
                 headers: dict[str, str] | None = None, **body: Any) -> tuple[bytes, float]:
    """The stream's raw bytes (``: ping`` comments left out: the edge writes
    one when a pause outlasts a heartbeat, on any stream) and its longest
    pause between two reads after the first. ``progress[text]``: the events
    read so far, as they come."""
    gaps: list[float] = []
    raw = b""
    payload = {"model": model, "stream": True, "messages": [{"role": "user", "content": text}],
               **body}
    if usage:
        payload["stream_options"] = {"include_usage": True}
    async with session.post(f"{url}/v1/chat/completions", json=payload,
                            headers={"Authorization": f"Bearer {DEV_KEY}",
                                     **(headers or {})}) as resp:
        assert resp.status == 200, await resp.text()
        last = time.monotonic()
        async for chunk in resp.content.iter_any():
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            raw += chunk
            if progress is not None:
                progress[text] = raw.count(b"\n\n")
    return raw.replace(b": ping\n\n", b""), max(gaps[1:], default=0.0)
