"""``tidegate up``: the whole gateway on one machine, as supervised child processes.

Two steps, so the CLI can set up logging from the effective config in between:

1. :func:`prepare` turns the command-line options into a :class:`Plan`: the
   effective :class:`~tidegate.config.Config` (file + environment + flags + the
   embedded servers' URLs + the dev key + the served models), the ports of the
   embedded servers and of the edge(s). It has no side effect beyond the data dir
   (created) and the dev key file (created once).
2. :class:`Launcher` runs the plan: embedded nats-server (JetStream state in
   ``<data-dir>/nats``) and redis-server when no external URL was given, then
   the dispatchers, workers and edges (``--dispatchers/--workers/--edges N``,
   one dispatcher and one edge by default), each ``python -m tidegate <tier>
   --config <data-dir>/tidegate.toml``. That file is the effective config from
   :func:`~tidegate.config.dump_toml`, and the children's environment is
   stripped of every ``TIDEGATE_*`` config variable, so each child sees exactly
   the config the launcher validated, nothing re-applied on top.

Supervision invariants:

* Every child is a :class:`~tidegate.run.servers.ManagedProcess`: own process
  group, ``PR_SET_PDEATHSIG``, log in ``<data-dir>/logs/<name>.log``.
* A child that exits on its own is restarted (:mod:`tidegate.run.supervisor`:
  backoff, logged, counted in ``<data-dir>/processes.json`` which ``tidegate
  status`` shows). Only a crash loop, or an embedded server that does not come
  back, stops the whole: the launcher names the child, prints its log tail,
  stops the rest and exits 1.
* Several edges share one port with ``SO_REUSEPORT`` (``edge.reuse_port``):
  the kernel spreads client connections across them.
* SIGINT/SIGTERM/SIGHUP stop every child in dependency order (edge first so
  open streams drain while workers still run, then workers, dispatcher, redis,
  nats), each wave SIGTERM, a bounded wait, SIGKILL; exit 0. A second signal
  SIGKILLs every child at once.
* One launcher per data dir (a lock file): two would share a JetStream store.

Metrics: the edge serves ``/metrics`` on its own port; the dispatcher and
each worker get a free port of their own (``TIDEGATE_METRICS_PORT`` in their
environment, on the edge's host), and the banner lists all of them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shlex
import signal
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import tidegate
from tidegate import config as tgconfig
from tidegate.broker import natsconfig
from tidegate.config import Config
from tidegate.errors import ConfigError, TidegateError
from tidegate.run.servers import (
    SIGKILL,
    ManagedProcess,
    NatsServer,
    RedisServer,
    connect_host,
    free_port,
    http_ok,
    port_is_free,
    stop_all,
    tcp_sockets,
)
from tidegate.run.supervisor import STATE_FILE, RestartPolicy, Supervisor, names
from tidegate.telemetry.observability import METRICS_HOST_ENV, METRICS_PORT_ENV

log = logging.getLogger("tidegate.launcher")

DEFAULT_NATS_PORT = 4222
DEFAULT_REDIS_PORT = 6379
DEV_KEY_PREFIX = "sk-tg-"
MODELS_TIMEOUT = 10.0  # seconds for GET {backend}/models
# SIGHUP (terminal closed) stops cleanly too; it does not exist on Windows.
_STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                      if hasattr(signal, name))
_SERVER_STOP_TIMEOUT = 10.0
_GRACE = 5.0  # beyond a tier's own shutdown deadline before SIGKILL


@dataclass(frozen=True, slots=True)
class UpOptions:
    """Command-line options of ``tidegate up`` (None: not given)."""

    config_path: str | None = None
    data_dir: Path = Path(".tidegate")
    host: str | None = None
    port: int | None = None
    nats_url: str | None = None
    redis_url: str | None = None
    workers: int = 1
    edges: int = 1
    dispatchers: int = 1
    backends: tuple[str, ...] = ()
    backend_key_env: str | None = None
    models: tuple[str, ...] = ()
    ready_timeout: float = 60.0
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # The embedded NATS runs with per-tier users and permissions
    # (tidegate.broker.permissions), as production should; --no-nats-auth
    # turns that off.
    nats_auth: bool = True


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything :class:`Launcher` needs; computed by :func:`prepare`."""

    options: UpOptions
    config: Config
    data_dir: Path
    nats_port: int | None  # None: external NATS at config.nats.url
    redis_port: int | None  # None: external Redis at config.redis.url
    child_env: dict[str, str] = field(default_factory=dict)
    # child name ("dispatcher", "worker-1", ...) -> its /metrics port
    metrics_ports: dict[str, int] = field(default_factory=dict)
    nats_auth: Path | None = None  # the embedded NATS's auth.conf, when it has one

    @property
    def config_file(self) -> Path:
        return self.data_dir / "tidegate.toml"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def base_url(self) -> str:
        return f"{self._origin(self.config.edge.port)}/v1"

    def _origin(self, port: int) -> str:
        host = connect_host(self.config.edge.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def metrics_urls(self) -> dict[str, str]:
        """Where every child serves ``/metrics``, edge first."""
        urls = {"edge": f"{self._origin(self.config.edge.port)}/metrics"}
        urls.update({name: f"{self._origin(port)}/metrics"
                     for name, port in self.metrics_ports.items()})
        return urls

    def env_for(self, name: str) -> dict[str, str]:
        """``child_env`` plus this child's metrics address, if it has one."""
        port = self.metrics_ports.get(name)
        if port is None:
            return self.child_env
        return {**self.child_env, METRICS_PORT_ENV: str(port),
                METRICS_HOST_ENV: self.config.edge.host}


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


def prepare(options: UpOptions, env: Mapping[str, str] | None = None) -> Plan:
    """Resolve options, environment and config file into a :class:`Plan`.

    Raises :class:`ConfigError` for an invalid config and :class:`TidegateError`
    for anything else the user must fix (port taken, backend not listing).
    """
    env = dict(os.environ if env is None else env)
    for flag, count in (("--workers", options.workers), ("--edges", options.edges),
                        ("--dispatchers", options.dispatchers)):
        if count < 1:
            raise ConfigError(f"{flag}: must be >= 1, got {count}")
    if options.models and not options.backends:
        raise ConfigError("--model names models of a --backend; give --backend URL too")
    if options.port is not None and not 0 < options.port <= 65535:
        raise ConfigError(f"--port: must be 1..65535, got {options.port}")

    config_path = options.config_path or env.get("TIDEGATE_CONFIG") or None
    overrides: dict[str, Any] = {}
    if options.host:
        overrides["edge"] = {"host": options.host}
    if options.nats_url:
        overrides["nats"] = {"url": options.nats_url}
    if options.redis_url:
        overrides["redis"] = {"url": options.redis_url}
    base = tgconfig.load(config_path, env, overrides)  # validates file + env first
    raw = _raw_toml(config_path)

    data_dir = options.data_dir.absolute()
    data_dir.mkdir(parents=True, exist_ok=True)

    external_nats = bool(options.nats_url or env.get("TIDEGATE_NATS_URL")
                         or env.get("TIDEGATE__NATS__URL") or _has_key(raw, "nats", "url"))
    external_redis = bool(options.redis_url or env.get("TIDEGATE_REDIS_URL")
                          or env.get("TIDEGATE__REDIS__URL") or _has_key(raw, "redis", "url"))
    nats_port = None if external_nats else free_port(preferred=DEFAULT_NATS_PORT)
    redis_port = None if external_redis else free_port(preferred=DEFAULT_REDIS_PORT)
    nats_auth: Path | None = None
    if nats_port is not None:
        overrides.setdefault("nats", {})["url"] = f"nats://127.0.0.1:{nats_port}"
        if options.nats_auth:
            auth_dir = data_dir / "nats-auth"
            nats_auth = natsconfig.write(auth_dir, base.nats.subjects)
            overrides["nats"]["credentials"] = natsconfig.credentials_setting(auth_dir)
    if redis_port is not None:
        overrides.setdefault("redis", {})["url"] = f"redis://127.0.0.1:{redis_port}/0"

    host = base.edge.host
    if options.port is not None:
        if not port_is_free(options.port, host):
            raise TidegateError(f"port {options.port} on {host} is already in use; "
                                f"pick another --port")
        port = options.port
    else:
        port = free_port(host, preferred=base.edge.port or None)
    overrides.setdefault("edge", {})["port"] = port
    if options.edges > 1:
        overrides["edge"]["reuse_port"] = True

    overrides["auth"] = {"dev_key": base.auth.dev_key or dev_key(data_dir)}
    if options.backends:
        overrides["models"] = _backend_models(options, env)

    config = tgconfig.load(config_path, env, overrides)
    taken = {config.edge.port, nats_port, redis_port}
    metrics_ports: dict[str, int] = {}
    for name in (*names("dispatcher", options.dispatchers), *names("worker", options.workers)):
        port = free_port(host)
        while port in taken:  # free_port may hand out a port picked above, not yet bound
            port = free_port(host)
        taken.add(port)
        metrics_ports[name] = port
    return Plan(options=options, config=config, data_dir=data_dir, nats_port=nats_port,
                redis_port=redis_port, child_env=child_environment(env),
                metrics_ports=metrics_ports, nats_auth=nats_auth)


def _raw_toml(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        return tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}  # already reported by config.load


def _has_key(raw: Mapping[str, Any], section: str, key: str) -> bool:
    table = raw.get(section)
    return isinstance(table, Mapping) and key in table


def dev_key(data_dir: Path) -> str:
    """The dev key kept in ``<data_dir>/dev_key``, created (mode 0600) on first use."""
    path = data_dir / "dev_key"
    with contextlib.suppress(FileNotFoundError):
        key = path.read_text().strip()
        if key:
            return key
    key = DEV_KEY_PREFIX + secrets.token_urlsafe(24)  # 24 bytes: 32 characters
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def _backend_models(options: UpOptions, env: Mapping[str, str]) -> list[dict[str, Any]]:
    key_env = options.backend_key_env or ""
    api_key = ""
    if key_env:
        api_key = env.get(key_env, "")
        if not api_key:
            raise ConfigError(f"--backend-key-env: environment variable {key_env} is not set")
    # A model name served by several --backend URLs is one model with that
    # many replicas (docs/routing.md), in the order the URLs were given.
    replicas: dict[str, list[str]] = {}
    for url in options.backends:
        base_url = url.rstrip("/")
        for name in list(options.models) or list_backend_models(base_url, api_key):
            if base_url not in replicas.setdefault(name, []):
                replicas[name].append(base_url)
    return [{"name": name, "backend": "openai", "api_key_env": key_env,
             **({"base_url": urls[0]} if len(urls) == 1 else {"base_urls": urls})}
            for name, urls in replicas.items()]


def list_backend_models(base_url: str, api_key: str = "",
                        timeout: float = MODELS_TIMEOUT) -> list[str]:
    """Model ids from an OpenAI-compatible ``GET {base_url}/models``."""
    url = f"{base_url.rstrip('/')}/models"
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    hint = "pass --model NAME (repeatable) to name the backend's models yourself"
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        raise TidegateError(f"GET {url} answered HTTP {exc.code}; {hint}") from None
    except (OSError, ValueError) as exc:
        raise TidegateError(f"could not list models with GET {url}: {exc}; {hint}") from None
    data = body.get("data") if isinstance(body, dict) else None
    names = [m["id"] for m in data or () if isinstance(m, dict) and isinstance(m.get("id"), str)]
    if not names:
        raise TidegateError(f"GET {url} listed no models; {hint}")
    return list(dict.fromkeys(names))


def child_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The environment of every child: no config variables, tidegate importable.

    Config variables are dropped because the children read the effective
    config file; applying e.g. ``TIDEGATE__EDGE__PORT`` again on top of it
    would undo the launcher's choices.
    """
    dropped = {"TIDEGATE_CONFIG", "TIDEGATE_NATS_URL", "TIDEGATE_REDIS_URL", "TIDEGATE_DEV_KEY"}
    out = {k: v for k, v in env.items() if k not in dropped and not k.startswith("TIDEGATE__")}
    root = str(Path(tidegate.__file__).resolve().parent.parent)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (root, out.get("PYTHONPATH", "")) if p)
    out["PYTHONUNBUFFERED"] = "1"
    return out


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------


class _EdgeProcess(ManagedProcess):
    """An edge child: ready once it listens itself and the port answers /readyz.

    With several edges on one port (``SO_REUSEPORT``) a probe of the port
    reaches any of them, so each edge's own listening socket (it binds only
    after connecting to NATS) is what tells this one apart.
    """

    def __init__(self, *args: Any, port: int, readyz: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.port, self.readyz = port, readyz

    def is_ready(self) -> bool:
        listening = tcp_sockets(self.pid or 0, self.port)
        return listening != 0 and http_ok(self.readyz)  # None: no /proc, the probe alone


class _Stopped(Exception):
    """A stop signal arrived during start-up."""


class Launcher:
    """Starts, watches and stops the children of one ``tidegate up``.

    Must run in the main thread: it installs signal handlers, and children
    forked from it carry ``PR_SET_PDEATHSIG`` bound to this thread.
    """

    def __init__(self, plan: Plan, out: IO[str] | None = None, err: IO[str] | None = None):
        self.plan = plan
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.stop_requested = threading.Event()
        self.nats: NatsServer | None = None
        self.redis: RedisServer | None = None
        self.dispatchers: list[ManagedProcess] = []
        self.workers: list[ManagedProcess] = []
        self.edges: list[ManagedProcess] = []
        self.supervisor = Supervisor(plan.options.restart, plan.data_dir / STATE_FILE,
                                     self._restart_ready)

    def children(self) -> Iterator[ManagedProcess]:
        """Every child started so far, in start order."""
        for child in (self.nats, self.redis, *self.dispatchers, *self.workers, *self.edges):
            if child is not None:
                yield child

    def run(self) -> int:
        """Start everything, print how to use it, supervise; the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}
        try:
            with _lock(self.plan.data_dir):
                try:
                    return self._run_locked()
                finally:
                    self.shutdown()  # still holding the lock: no overlap with a successor
        except TidegateError as exc:
            self._error(str(exc))
            return 1
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run_locked(self) -> int:
        try:
            self._start()
        except _Stopped:
            return 0
        except TidegateError as exc:
            self._error(f"start failed: {exc}")
            return 1
        self._print_banner()
        return self._supervise()

    # -- start -----------------------------------------------------------------

    def _start(self) -> None:
        plan, cfg = self.plan, self.plan.config
        plan.log_dir.mkdir(parents=True, exist_ok=True)
        if plan.nats_port is not None:
            auth = ["-c", str(plan.nats_auth)] if plan.nats_auth else []
            self.nats = NatsServer(plan.data_dir / "nats", port=plan.nats_port,
                                   log_path=plan.log_dir / "nats.log", extra_args=auth)
            self.nats.name = "nats"
            log.info("starting nats-server on port %d", plan.nats_port)
            self._start_server(self.nats)
        if plan.redis_port is not None:
            self.redis = RedisServer(plan.data_dir / "redis", port=plan.redis_port,
                                     log_path=plan.log_dir / "redis.log")
            self.redis.name = "redis"
            log.info("starting redis-server on port %d", plan.redis_port)
            self._start_server(self.redis)

        fd = os.open(plan.config_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:  # holds the dev key: owner only
            f.write(tgconfig.dump_toml(cfg))

        # Appended one by one: a failed spawn must not hide earlier children
        # from shutdown().
        for name in names("dispatcher", plan.options.dispatchers):
            self.dispatchers.append(self._tier(name, "dispatcher"))
        for name in names("worker", plan.options.workers):
            self.workers.append(self._tier(name, "worker"))
        edge_url = f"{plan.base_url.removesuffix('/v1')}/readyz"
        for name in names("edge", plan.options.edges):
            self.edges.append(self._tier(name, "edge", edge_url=edge_url))
        log.info("started %d dispatcher(s), %d worker(s) and %d edge(s); waiting for %s",
                 len(self.dispatchers), len(self.workers), len(self.edges), edge_url)
        self._wait_ready([*self.dispatchers, *self.workers, *self.edges])
        for child in self.children():
            self.supervisor.add(child, server=child in (self.nats, self.redis))

    def _start_server(self, server: ManagedProcess) -> None:
        server.spawn()
        self._wait_ready([server])

    def _tier(self, name: str, tier: str, edge_url: str = "") -> ManagedProcess:
        argv = [sys.executable, "-m", "tidegate", tier, "--config", str(self.plan.config_file)]
        log_path, env = self.plan.log_dir / f"{name}.log", self.plan.env_for(name)
        child = (_EdgeProcess(name, argv, log_path, env=env, port=self.plan.config.edge.port,
                              readyz=edge_url)
                 if edge_url else ManagedProcess(name, argv, log_path, env=env))
        child.spawn()
        return child

    def _wait_ready(self, children: list[ManagedProcess]) -> None:
        """Until every child's probe passes; any exit or the timeout is an error."""
        timeout = self.plan.options.ready_timeout
        pending = list(children)
        deadline = time.monotonic() + timeout
        while pending:
            if self.stop_requested.is_set():
                raise _Stopped
            for child in self.children():
                code = child.poll()
                if code is not None:
                    raise TidegateError(child.describe_failure(
                        f"{child.name} exited with code {code} while starting"))
            pending = [c for c in pending if not c.is_ready()]
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TidegateError(pending[0].describe_failure(
                    f"{pending[0].name} was not ready within {timeout:g}s"))
            self.stop_requested.wait(0.1)

    # -- supervise ---------------------------------------------------------------

    def _supervise(self) -> int:
        while not self.stop_requested.wait(0.2):
            failure = self.supervisor.tick()
            if failure is not None:
                self._error(failure)
                return 1
        return 0

    def _restart_ready(self, server: ManagedProcess) -> None:
        """Wait for a restarted embedded server (the supervisor's callback).

        Only the server is watched: tiers keep retrying NATS/Redis meanwhile,
        and one that exits is the supervisor's next tick's business.
        """
        deadline = time.monotonic() + self.plan.options.ready_timeout
        while not server.is_ready():
            code = server.poll()
            if code is not None:
                raise TidegateError(server.describe_failure(
                    f"{server.name} exited with code {code} while restarting"))
            if self.stop_requested.is_set():
                return
            if time.monotonic() >= deadline:
                raise TidegateError(server.describe_failure(
                    f"{server.name} was not ready within {self.plan.options.ready_timeout:g}s"))
            self.stop_requested.wait(0.1)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop_requested.is_set():
            # Second signal: the operator will not wait. Signals only, no
            # waiting: the main thread may be inside a wait of its own.
            for child in self.children():
                child.send_signal(SIGKILL)
            return
        self.stop_requested.set()

    def shutdown(self) -> None:
        """Stop every child, dependents first. Idempotent; never raises."""
        cfg = self.plan.config
        waves: list[tuple[list[ManagedProcess], float]] = [
            (self.edges, cfg.edge.shutdown_timeout + _GRACE),
            (self.workers, cfg.worker.shutdown_timeout + _GRACE),
            (self.dispatchers, _SERVER_STOP_TIMEOUT + _GRACE),
            ([self.redis] if self.redis else [], _SERVER_STOP_TIMEOUT),
            ([self.nats] if self.nats else [], _SERVER_STOP_TIMEOUT),
        ]
        for procs, timeout in waves:
            live = [p for p in procs if p.running]
            if live:
                log.info("stopping %s", ", ".join(p.name for p in live))
            for p in stop_all(procs, timeout):
                log.warning("%s did not stop within %gs of SIGTERM: killed (see %s)",
                            p.name, timeout, p.log_path)
        self.supervisor.remove_state()

    # -- output ------------------------------------------------------------------

    def _error(self, message: str) -> None:
        print(f"tidegate up: {message}", file=self.err, flush=True)

    def _print_banner(self) -> None:
        print(banner(self.plan), file=self.out, flush=True)


def banner(plan: Plan) -> str:
    """What ``tidegate up`` prints once everything is ready."""
    cfg = plan.config
    url, key = plan.base_url, cfg.auth.dev_key
    model = cfg.models[0].name
    body = json.dumps({"model": model, "stream": True,
                       "messages": [{"role": "user", "content": "Say hello"}]})
    curl = (f"curl -N {url}/chat/completions \\\n"
            f"    -H {shlex.quote('Authorization: Bearer ' + key)} \\\n"
            f"    -H 'Content-Type: application/json' \\\n"
            f"    -d {shlex.quote(body)}")
    python = "\n".join([
        "from openai import OpenAI",
        "",
        f"client = OpenAI(base_url={url!r}, api_key={key!r})",
        "stream = client.chat.completions.create(",
        f"    model={model!r},",
        '    messages=[{"role": "user", "content": "Say hello"}],',
        "    stream=True,",
        ")",
        "for chunk in stream:",
        "    if chunk.choices:",
        '        print(chunk.choices[0].delta.content or "", end="", flush=True)',
        "print()",
    ])
    return "\n".join([
        "",
        "tidegate is up.",
        "",
        f"  URL:      {url}",
        f"  API key:  {key}",
        f"  Models:   {', '.join(m.name for m in cfg.models)}",
        f"  Workers:  {plan.options.workers}",
        *([f"  Edges:    {plan.options.edges} on one port (SO_REUSEPORT)"]
          if plan.options.edges > 1 else []),
        *([f"  Dispatchers: {plan.options.dispatchers}"] if plan.options.dispatchers > 1 else []),
        f"  NATS:     {cfg.nats.url}{'' if plan.nats_port is None else ' (embedded)'}",
        f"  Redis:    {cfg.redis.url}{'' if plan.redis_port is None else ' (embedded)'}",
        f"  Logs:     tail -f {shlex.quote(str(plan.log_dir))}/*.log",
        *_metrics_lines(plan),
        f"  Status:   tidegate status --config {shlex.quote(str(plan.config_file))}",
        "",
        "Stream a chat completion:",
        "",
        _indent(curl),
        "",
        "Or with the openai SDK (pip install openai):",
        "",
        _indent(python),
        "",
        "Press Ctrl-C to stop.",
    ])


def _metrics_lines(plan: Plan) -> list[str]:
    return [f"  {'Metrics:' if i == 0 else '':<10}{url}  ({name})"
            for i, (name, url) in enumerate(plan.metrics_urls().items())]


def _indent(text: str) -> str:
    return "\n".join(f"  {line}" if line else "" for line in text.splitlines())


@contextlib.contextmanager
def _lock(data_dir: Path) -> Iterator[None]:
    """Exclusive lock on ``<data_dir>/up.lock`` for the launcher's lifetime."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, nothing else changes
        yield
        return
    with open(data_dir / "up.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise TidegateError(f"another tidegate up is running with data dir {data_dir}; "
                                f"stop it or pass another --data-dir") from None
        yield


def up(options: UpOptions) -> int:
    """``tidegate up`` without the CLI's logging setup (used by tests and embedders)."""
    return Launcher(prepare(options)).run()
