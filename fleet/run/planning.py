"""``tidegate up``, step one: the command-line options, environment and config
file resolved into a :class:`Plan` (the effective config, the embedded servers'
ports, the children's environment); see :mod:`fleet.run.launcher`."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import tomllib
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tidegate
from fleet.run.ports import connect_host, free_port, port_is_free
from fleet.run.supervisor import RestartPolicy, names
from tidegate import config as tgconfig
from tidegate.broker import natsconfig
from tidegate.config import Config
from tidegate.errors import ConfigError, TidegateError
from tidegate.telemetry.observability import METRICS_HOST_ENV, METRICS_PORT_ENV

DEFAULT_NATS_PORT = 4222
DEFAULT_REDIS_PORT = 6379
DEV_KEY_PREFIX = "sk-tg-"
DEFAULT_CONSOLE_PORT = 8090  # tidegate console's default (fleet.cli)
MODELS_TIMEOUT = 10.0  # seconds for GET {backend}/models
PROPS_TIMEOUT = 3.0  # seconds for llama-server's GET /props (best effort)

# An edge child's id (``edge.edge_id``), from ``tidegate up``'s child name.
EDGE_ID_ENV = "TIDEGATE__EDGE__EDGE_ID"


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
    # The embedded NATS's HTTP monitoring port (lists users and connections to
    # anyone who asks): off unless given, then bound to 127.0.0.1.
    nats_monitor_port: int | None = None
    # The operator console (fleet.run.console) on 127.0.0.1: None picks a
    # free port (8090 when free), 0 runs none.
    console_port: int | None = None


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
    redis_password: str | None = field(default=None, repr=False)  # the embedded Redis's
    console_port: int | None = None  # the operator console's, on 127.0.0.1; None: none

    @property
    def config_file(self) -> Path:
        return self.data_dir / "tidegate.toml"

    @property
    def log_dir(self) -> Path:
        return self.data_dir / "logs"

    @property
    def base_url(self) -> str:
        return f"{self._origin(self.config.edge.port)}/v1"

    def _origin(self, port: int, host: str | None = None) -> str:
        host = connect_host(self.config.edge.host if host is None else host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    @property
    def console_url(self) -> str | None:
        """Where ``tidegate console`` serves the operator page, if it runs."""
        return None if self.console_port is None else \
            f"http://127.0.0.1:{self.console_port}/console"

    def metrics_urls(self) -> dict[str, str]:
        """Where every child serves ``/metrics``, edges first (an edge on its
        API port only with ``edge.metrics_public`` and no port of its own)."""
        urls = {}
        if self.config.edge.metrics_public and not any(
                name.startswith("edge") for name in self.metrics_ports):
            urls["edge"] = f"{self._origin(self.config.edge.port)}/metrics"
        urls.update({name: f"{self._origin(port, self.config.edge.metrics_host)}/metrics"
                     for name, port in self.metrics_ports.items()})
        return urls

    def env_for(self, name: str) -> dict[str, str]:
        """``child_env`` plus this child's metrics address, if it has one; an
        edge's id is its name (its own NATS login's, ``edge.<name>``)."""
        env = dict(self.child_env)
        if name in names("edge", self.options.edges):
            env[EDGE_ID_ENV] = name
        port = self.metrics_ports.get(name)
        if port is not None:
            env.update({METRICS_PORT_ENV: str(port),
                        METRICS_HOST_ENV: self.config.edge.metrics_host})
        return env


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
    monitor = options.nats_monitor_port
    if monitor is not None and not 0 < monitor <= 65535:
        raise ConfigError(f"--nats-monitor-port: must be 1..65535, got {monitor}")
    console = options.console_port
    if console is not None and not 0 <= console <= 65535:
        raise ConfigError(f"--console-port: must be 1..65535 (0: no console), got {console}")
    if console and not port_is_free(console, "127.0.0.1"):
        raise TidegateError(f"--console-port {console} on 127.0.0.1 is already in use")
    if monitor is not None and not port_is_free(monitor, "127.0.0.1"):
        raise TidegateError(f"--nats-monitor-port {monitor} on 127.0.0.1 is already in use")

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
            # One login per edge: a stolen one reads no other edge's replies.
            nats_auth = natsconfig.write(auth_dir, base.nats.subjects,
                                         edges=tuple(names("edge", options.edges)))
            overrides["nats"]["credentials"] = natsconfig.credentials_setting(auth_dir)
    redis_password: str | None = None
    if redis_port is not None:
        # The embedded Redis requires a password: the quota and queue state
        # must not be open to every local process (docs/security.md).
        redis_password = secrets.token_urlsafe(24)
        overrides.setdefault("redis", {})["url"] = (
            f"redis://:{redis_password}@127.0.0.1:{redis_port}/0")

    host = base.edge.host
    if options.port is not None:
        if not port_is_free(options.port, host):
            raise TidegateError(f"port {options.port} on {host} is already in use; "
                                f"pick another --port")
        port = options.port
    else:
        port = free_port(host, preferred=base.edge.port or None)
    overrides.setdefault("edge", {})["port"] = port
    # The gRPC ingress is on under `tidegate up` (off by default in config):
    # the configured port, else any free one (printed in the banner). Not
    # gRPC's customary 50051: another service, or another `tidegate up`,
    # may hold it or take it between now and the edge's bind.
    grpc_port = base.edge.grpc_port or free_port(host)
    while grpc_port == port:
        grpc_port = free_port(host)
    overrides["edge"]["grpc_port"] = grpc_port
    if options.edges > 1:
        overrides["edge"]["reuse_port"] = True

    overrides["auth"] = {"dev_key": base.auth.dev_key or dev_key(data_dir)}
    if options.backends:
        overrides["models"] = _backend_models(options, env)

    config = tgconfig.load(config_path, env, overrides)
    taken = {config.edge.port, config.edge.grpc_port, nats_port, redis_port}
    metrics_ports: dict[str, int] = {}
    # Edges too, unless edge.metrics_port = 0 turned their metrics server off.
    edges = names("edge", options.edges) if config.edge.metrics_port else ()
    for name in (*edges, *names("dispatcher", options.dispatchers),
                 *names("worker", options.workers)):
        port = free_port(config.edge.metrics_host)
        while port in taken:  # free_port may hand out a port picked above, not yet bound
            port = free_port(config.edge.metrics_host)
        taken.add(port)
        metrics_ports[name] = port
    console_port: int | None = console or None
    if console is None:
        console_port = free_port(preferred=DEFAULT_CONSOLE_PORT)
        while console_port in taken:
            console_port = free_port()
    return Plan(options=options, config=config, data_dir=data_dir, nats_port=nats_port,
                redis_port=redis_port, redis_password=redis_password,
                child_env=child_environment(env),
                metrics_ports=metrics_ports, nats_auth=nats_auth, console_port=console_port)


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
    # The smallest context length any replica reports bounds the model's
    # max_output_tokens (no answer can be longer than its context).
    contexts: dict[str, int] = {}
    for url in options.backends:
        base_url = url.rstrip("/")
        listed = {} if options.models else list_backend_models(base_url, api_key)
        if listed and None in listed.values():
            props = llamacpp_context(base_url, api_key)
            listed = {name: n or props for name, n in listed.items()}
        for name in list(options.models) or list(listed):
            if base_url not in replicas.setdefault(name, []):
                replicas[name].append(base_url)
            if (n := listed.get(name)) is not None:
                contexts[name] = min(contexts.get(name, n), n)
    return [{"name": name, "backend": "openai", "api_key_env": key_env,
             **({"base_url": urls[0]} if len(urls) == 1 else {"base_urls": urls}),
             **({"max_output_tokens": contexts[name]} if name in contexts else {})}
            for name, urls in replicas.items()]


def _get_json(url: str, api_key: str, timeout: float) -> Any:
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _context(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def list_backend_models(base_url: str, api_key: str = "",
                        timeout: float = MODELS_TIMEOUT) -> dict[str, int | None]:
    """Model ids from an OpenAI-compatible ``GET {base_url}/models``, each with
    the context length the backend reports for it (vLLM's ``max_model_len``),
    None where it reports none."""
    url = f"{base_url.rstrip('/')}/models"
    hint = "pass --model NAME (repeatable) to name the backend's models yourself"
    try:
        body = _get_json(url, api_key, timeout)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket
        raise TidegateError(f"GET {url} answered HTTP {exc.code}; {hint}") from None
    except (OSError, ValueError) as exc:
        raise TidegateError(f"could not list models with GET {url}: {exc}; {hint}") from None
    data = body.get("data") if isinstance(body, dict) else None
    models: dict[str, int | None] = {}
    for m in data or ():
        if isinstance(m, dict) and isinstance(m.get("id"), str):
            models.setdefault(m["id"], _context(m.get("max_model_len")))
    if not models:
        raise TidegateError(f"GET {url} listed no models; {hint}")
    return models


def llamacpp_context(base_url: str, api_key: str = "",
                     timeout: float = PROPS_TIMEOUT) -> int | None:
    """llama-server's context length per slot (``GET /props``,
    ``default_generation_settings.n_ctx``, served at the root beside
    ``/v1``); None when the backend has no such page (not llama.cpp)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        body = _get_json(f"{root}/props", api_key, timeout)
    except urllib.error.HTTPError as exc:
        exc.close()
        return None
    except (OSError, ValueError):
        return None
    settings = body.get("default_generation_settings") if isinstance(body, dict) else None
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return _context(n_ctx if n_ctx is not None else
                    body.get("n_ctx") if isinstance(body, dict) else None)


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
