"""Typed configuration: one TOML file plus environment overrides, validated once.

Every component gets a frozen dataclass; nothing reads the environment or a
dict after :func:`load` returns. Unknown keys are errors (a typo must not be
silently ignored), and every message names the key: ``models[1].max_streams:
must be >= 1, got 0``.

Precedence, lowest to highest: built-in defaults < TOML file < environment.

Environment:

* ``TIDEGATE_CONFIG`` - path of the TOML file (when ``--config`` is not given).
* ``TIDEGATE_NATS_URL``, ``TIDEGATE_REDIS_URL`` - broker and quota store URLs.
* ``TIDEGATE_DEV_KEY`` - an API key accepted by the edge (tenant ``default``).
* ``TIDEGATE__<SECTION>__<KEY>=<value>`` - any scalar key of a section, e.g.
  ``TIDEGATE__EDGE__PORT=9000``. The value is read as a TOML value when it parses
  as one (numbers, booleans, ``["a", "b"]``) and as a plain string otherwise.

See ``docs/configuration.md`` for every key with its default and reason.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tidegate.errors import ConfigError
from tidegate.wire.subjects import Subjects

BackendKind = Literal["simulator", "openai"]
# A model's worker concurrency: a pinned number, or "auto" (workers.limiter).
StreamLimit = int | Literal["auto"]
StorageKind = Literal["file", "memory"]
QuotaFailure = Literal["closed", "open"]
AffinityMode = Literal["auto", "off"]


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """The built-in model: deterministic text at a configurable pace."""

    ttft: float = 0.05  # seconds before the first token
    tokens_per_second: float = 50.0
    length: int = 64  # tokens generated when the request sets no max_tokens
    embedding_dimensions: int = 256  # vector size when an embeddings request sets none
    # A prefix-cache model (docs/routing.md): the first token also waits this
    # many seconds per prompt character this worker's cache did not hold.
    prefill_per_char: float = 0.0


@dataclass(frozen=True, slots=True)
class QueueModeConfig:
    """When a model's backend gets slow, admit only what it handled well and
    queue the rest fairly (see docs/queue-mode.md). Off while ``ttft_p99`` is 0."""

    ttft_p99: float = 0.0  # seconds; P99 TTFT above this is a bad window (0 = never queue)
    window: float = 10.0  # seconds per measurement window
    enter_after: int = 3  # consecutive bad windows before queue mode
    exit_after: int = 3  # consecutive good windows before leaving it
    exit_ratio: float = 0.7  # a good window in queue mode has P99 below ttft_p99 x this
    max_queued: int = 1000  # hard bound; past it, 503 + Retry-After
    ttl: float = 60.0  # a queued request waits at most this long, then 503
    min_concurrency: int = 1  # admission floor while in queue mode


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model that clients can name, and how workers reach it."""

    name: str
    backend: BackendKind = "simulator"
    aliases: tuple[str, ...] = ()
    base_url: str = ""  # OpenAI-compatible base, e.g. http://127.0.0.1:8000/v1
    # Several replicas of one model (instead of base_url): each has its own
    # queue besides the model's shared one, see docs/routing.md.
    base_urls: tuple[str, ...] = ()
    upstream_model: str = ""  # name the backend knows; defaults to `name`
    api_key_env: str = ""  # environment variable holding the backend's API key
    # Concurrent streams per worker process: a number pins it; "auto" lets
    # each worker find what the backend serves well from its latency
    # (workers.limiter), between min_streams and max_streams_limit. Unset
    # (None): "auto" for backend = "openai", 64 for the simulator, whose pace
    # does not depend on load (so there is no limit to find).
    max_streams: StreamLimit | None = None
    min_streams: int = 4  # "auto" never goes below this, and starts from it
    max_streams_limit: int = 1024  # "auto" never goes above this
    # "auto": time per output token (and, 1.5x as lenient, time to first byte)
    # may exceed its uncongested baseline by this factor before the worker
    # backs off. Larger trades latency for throughput.
    latency_tolerance: float = 1.3
    connect_timeout: float = 10.0
    first_byte_timeout: float = 300.0  # backend silence before its first byte
    idle_timeout: float = 120.0  # backend silence between two chunks
    # Tokens reserved against quotas for the completion when the request sets
    # no max_tokens (the prompt is estimated separately); actual usage
    # reconciles the reservation afterwards.
    reserve_max_tokens: int = 1024
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    queue: QueueModeConfig = field(default_factory=QueueModeConfig)
    # Every streaming request for this model is resumable (docs/resume.md).
    resumable: bool = False

    def __post_init__(self) -> None:
        if self.max_streams is None:  # the backend's default (see max_streams)
            object.__setattr__(self, "max_streams",
                               "auto" if self.backend == "openai" else 64)

    @property
    def backend_model(self) -> str:
        return self.upstream_model or self.name

    @property
    def replicas(self) -> tuple[str, ...]:
        """The base URL of every backend replica (``base_urls``, else ``base_url``)."""
        return self.base_urls or ((self.base_url,) if self.base_url else ())

    @property
    def replica_names(self) -> tuple[str, ...]:
        """Each replica's name: its URL without the scheme (``10.0.0.5:8000/v1``),
        stable across restarts and readable in ``tidegate status``."""
        return tuple(replica_name(url) for url in self.replicas)

    def for_replica(self, name: str) -> ModelConfig:
        """This model as served by one replica (its ``base_url``)."""
        url = dict(zip(self.replica_names, self.replicas, strict=True))[name]
        return dataclasses.replace(self, base_url=url, base_urls=())

    @property
    def adaptive(self) -> bool:
        """Whether workers size this model's concurrency themselves."""
        return self.max_streams == "auto"

    @property
    def initial_streams(self) -> int:
        """A worker's slots at start: the pinned number, or where "auto" begins."""
        return self.max_streams if isinstance(self.max_streams, int) else self.min_streams

    @property
    def streams_ceiling(self) -> int:
        """The most slots a worker may ever have for this model."""
        return self.max_streams if isinstance(self.max_streams, int) else self.max_streams_limit


def replica_name(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    edge_id: str = ""  # unique per process; generated when empty
    max_body_bytes: int = 1 << 20  # larger request bodies get 413
    admission_timeout: float = 30.0  # no dispatcher answer within this: 503
    # A request publish that gets no PubAck (a NATS node died, a leader
    # election) is retried for this long before 503 broker_unavailable; the
    # Nats-Msg-Id dedup makes the retry safe. 0: answer 503 at once. Capped
    # at half of admission_timeout, so the dispatcher still has time after it.
    publish_patience: float = 10.0
    queue_timeout: float = 300.0  # admitted, but no worker started it within this: 503
    request_timeout: float = 1800.0  # hard cap on one response
    max_response_bytes: int = 8 << 20  # non-streaming response body cap
    shutdown_timeout: float = 30.0  # SIGTERM: open streams may finish within this
    # A client whose socket does not drain within this is disconnected and its
    # request cancelled: it would otherwise hold a worker slot and a window.
    slow_client_timeout: float = 30.0
    # TCP keepalive on client sockets (seconds idle before probing, seconds
    # between probes, probes before the kernel drops the connection); 0 = off.
    keepalive_idle: int = 60
    keepalive_interval: int = 10
    keepalive_count: int = 6
    # SO_REUSEPORT on the listening socket: several edge processes on one host
    # share one port and the kernel spreads connections across them.
    reuse_port: bool = False
    # -- hostile-client limits (docs/security.md) --
    max_json_depth: int = 64  # deeper JSON bodies get 400 invalid_json
    header_timeout: float = 10.0  # first request's headers must arrive within this (slowloris)
    body_timeout: float = 30.0  # the whole body must arrive within this, else 408
    idle_timeout: float = 75.0  # an idle kept-alive connection is closed after this
    max_line_size: int = 8190  # request line bytes
    max_field_size: int = 8190  # bytes of one header line
    max_headers: int = 100  # header lines per request
    max_connections: int = 20_000  # open client connections per edge (0 = no cap)
    max_connections_per_ip: int = 1_000  # open connections per client address (0 = no cap)
    # HTTPS: PEM certificate chain and key; both empty = plain HTTP.
    tls_cert: str = ""
    tls_key: str = ""


@dataclass(frozen=True, slots=True)
class WsConfig:
    """WebSocket ingress (``GET /v1/ws`` on the edge, docs/websocket.md)."""

    max_concurrent: int = 16  # generations at once per socket; more get too_many_concurrent
    # Largest client frame; a bigger one closes the socket with 1009.
    max_message_bytes: int = 1 << 20
    auth_timeout: float = 10.0  # no Bearer header: the auth message must come within this
    # Liveness: a ping only after idle_before_ping seconds without traffic either
    # way, then every ping_interval while still idle; a ping unanswered for
    # pong_timeout is missed, and max_missed_pongs misses in a row close the socket.
    idle_before_ping: float = 30.0
    ping_interval: float = 20.0
    pong_timeout: float = 20.0
    max_missed_pongs: int = 2
    # Also send {"type": "ping"} text frames (browsers cannot see protocol pings).
    app_pings: bool = False
    # permessage-deflate: ~50 KiB of zlib state per socket and CPU per frame.
    compress: bool = False


@dataclass(frozen=True, slots=True)
class SessionConfig:
    """What edge and worker must agree on for one stream."""

    window_bytes: int = 64 << 10  # unacked bytes a worker may have in flight
    window_msgs: int = 128  # unacked messages a worker may have in flight
    heartbeat_interval: float = 15.0  # worker heartbeat / edge ": ping" while silent
    worker_lost_after: int = 3  # heartbeats missed before the edge gives up
    # A worker with output unacknowledged for this long takes the edge (or its
    # client) as gone and cancels the backend. Above edge.slow_client_timeout,
    # so a slow client is handled by its edge, with a clear error, first.
    ack_timeout: float = 40.0


@dataclass(frozen=True, slots=True)
class NatsConfig:
    url: str = "nats://127.0.0.1:4222"
    subject_prefix: str = "tg"
    connect_timeout: float = 5.0
    request_timeout: float = 5.0  # JetStream publish / API calls
    # Per-tier login written by `tidegate nats-config` (a TOML file: user,
    # password, inbox_prefix); "{tier}" is replaced by the connecting tier's
    # name (edge, dispatcher, worker, admin). Empty: connect without auth.
    credentials: str = ""
    # TLS to NATS: CA bundle to verify the server, optional client cert + key.
    # A tls:// URL or tls_ca turns TLS on.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    url: str = "redis://127.0.0.1:6379/0"
    timeout: float = 2.0


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    """JetStream stream limits. A full requests stream is load shedding: 503."""

    replicas: int = 1
    storage: StorageKind = "file"
    requests_max_msgs: int = 100_000
    requests_max_bytes: int = 1 << 30
    jobs_max_msgs: int = 100_000
    jobs_max_bytes: int = 1 << 30
    duplicate_window: float = 120.0  # Nats-Msg-Id dedup window, seconds
    max_age: float = 3600.0  # a request older than this is useless to anyone
    usage_max_age: float = 86400.0  # usage records are kept this long for billing consumers
    usage_max_bytes: int = 1 << 30


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    batch: int = 64  # requests pulled per fetch
    # Redis (quota store) unreachable: "closed" rejects with 503 (no request
    # runs unmetered), "open" admits without quotas. Either way it is logged.
    quota_failure: QuotaFailure = "closed"
    # Redelivery delay when a dispatcher dies holding a request. Dispatching takes
    # milliseconds, so this can be short; it must stay well below
    # edge.admission_timeout or clients time out just as their request is retried.
    ack_wait: float = 10.0
    fetch_timeout: float = 1.0


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    # JetStream redelivers a job after this without progress (in-progress acks
    # go every third of it). Below heartbeat_interval x (worker_lost_after - 1)
    # so a job whose worker died before its first chunk restarts elsewhere
    # before its edge gives up.
    ack_wait: float = 20.0
    max_deliver: int = 5
    read_bytes: int = 16 << 10  # largest chunk message (whole SSE events) to the edge
    # Messages to one edge within one loop iteration go as one NATS message of
    # at most this many bytes (tidegate.mux); 0 = one NATS message each.
    coalesce_bytes: int = 128 << 10
    fetch_timeout: float = 1.0
    shutdown_timeout: float = 60.0  # SIGTERM: in-flight jobs may finish within this
    max_response_bytes: int = 8 << 20  # non-streaming backend body cap
    models: tuple[str, ...] = ()  # serve only these models; empty = every configured model
    # Of models with several replicas, serve only these (replica names, see
    # ModelConfig.replica_names); empty = every replica.
    replicas: tuple[str, ...] = ()
    # A redelivered job waits this long for its edge to confirm the client is
    # still there and got nothing yet; otherwise it is dropped, not run twice.
    resume_timeout: float = 5.0


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Session affinity across a model's replicas (docs/routing.md). Models
    with one replica are not affected."""

    affinity: AffinityMode = "auto"
    home_ttl: float = 600.0  # a conversation's home is forgotten after this idle time
    # A job routed to its home that no worker claimed within this also goes to
    # the shared queue (a stale registry, a replica that just died).
    max_affinity_wait: float = 0.5
    key_user: bool = False  # mix the request's `user` into the affinity key
    prefix_bytes: int = 4096  # prefix text hashed into the key, at most


@dataclass(frozen=True, slots=True)
class BatchConfig:
    """The Files + Batches API (docs/batch.md). Limits default to OpenAI's."""

    max_file_bytes: int = 200 << 20  # an upload larger than this gets 413
    max_lines: int = 50_000  # requests per batch input file
    max_line_bytes: int = 1 << 20  # one input line (a request must fit one NATS message)
    max_retries: int = 3  # transient failures (5xx, worker lost) retried per line first
    max_window: float = 86400.0  # longest completion_window accepted, seconds ("24h")
    file_ttl: float = 30 * 86400.0  # files (inputs and results) are kept this long
    lease: float = 3.0  # the batch runner's leadership lease; a dead runner's successor waits this
    max_running: int = 512  # batch lines in flight at once, whatever the free slots say
    # While interactive jobs run on a model, batch holds at most this share of
    # the slots they leave free (rounded up); with none running, every free slot.
    share_under_load: float = 0.1


@dataclass(frozen=True, slots=True)
class ResumeConfig:
    """Resumable streams (docs/resume.md)."""

    retention: float = 600.0  # how long a stream's log can be read after it was written
    grace: float = 15.0  # generation continues this long after the last reader left
    max_grace: float = 300.0  # cap on a request's X-Tidegate-Resume-Grace
    max_stream_bytes: int = 8 << 20  # log bound per stream; past it, no resume
    max_bytes: int = 1 << 30  # the whole log stream (oldest streams age out first)
    retry_ms: int = 1000  # the SSE `retry:` the client's EventSource waits before reconnecting
    # A resumed reader re-attaches this often; the worker drops a reader it has
    # not heard from for 3 of these (an edge killed without a word).
    attach_interval: float = 2.0


@dataclass(frozen=True, slots=True)
class AuthConfig:
    keys: tuple[str, ...] = ()  # static API keys, tenant "default"
    dev_key: str = ""


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = "INFO"
    json: bool = False


@dataclass(frozen=True, slots=True)
class Config:
    edge: EdgeConfig = field(default_factory=EdgeConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    ws: WsConfig = field(default_factory=WsConfig)
    nats: NatsConfig = field(default_factory=NatsConfig)
    redis: RedisConfig = field(default_factory=RedisConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    models: tuple[ModelConfig, ...] = (ModelConfig(name="tidegate-sim", aliases=("sim",)),)

    def model_index(self) -> dict[str, ModelConfig]:
        """Every name a client may use (names and aliases) -> its model."""
        index: dict[str, ModelConfig] = {}
        for model in self.models:
            for name in (model.name, *model.aliases):
                index[name] = model
        return index

    def api_keys(self) -> tuple[str, ...]:
        return (*self.auth.keys, self.auth.dev_key) if self.auth.dev_key else self.auth.keys


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def load(path: str | os.PathLike[str] | None = None,
         env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the config from defaults, the TOML file, the environment and
    ``overrides`` (a nested dict, e.g. from CLI flags), in that order."""
    env = os.environ if env is None else env
    path = path or env.get("TIDEGATE_CONFIG") or None
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    _merge(raw, _env_overrides(env))
    if overrides:
        _merge(raw, dict(overrides))
    return from_dict(raw)


def from_dict(raw: Mapping[str, Any]) -> Config:
    config: Config = _build(Config, raw, "")
    _check(config)
    return config


def dump_toml(config: Config) -> str:
    """Serialise a config back to TOML (used by the launcher to hand the exact
    effective config to its child processes)."""
    lines: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name == "models":
            continue
        lines.append(f"[{f.name}]")
        lines.extend(_toml_items(value))
        lines.append("")
    for model in config.models:
        lines.append("[[models]]")
        lines.extend(_toml_items(model, skip=("simulator", "queue")))
        lines.append("[models.simulator]")
        lines.extend(_toml_items(model.simulator))
        lines.append("[models.queue]")
        lines.extend(_toml_items(model.queue))
        lines.append("")
    return "\n".join(lines)


def _toml_items(obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    return [f"{f.name} = {_toml_value(getattr(obj, f.name))}"
            for f in dataclasses.fields(obj) if f.name not in skip]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_str(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


_ENV_SHORTCUTS = {
    "TIDEGATE_NATS_URL": ("nats", "url"),
    "TIDEGATE_REDIS_URL": ("redis", "url"),
    "TIDEGATE_DEV_KEY": ("auth", "dev_key"),
}


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (section, key) in _ENV_SHORTCUTS.items():
        if env.get(name):
            out.setdefault(section, {})[key] = env[name]
    for name, value in env.items():
        if not name.startswith("TIDEGATE__"):
            continue
        parts = name[len("TIDEGATE__"):].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"environment variable {name}: expected TIDEGATE__<SECTION>__<KEY>")
        section, key = parts
        out.setdefault(section, {})[key] = _parse_env_value(value)
    return out


def _parse_env_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _build(cls: type[Any], raw: Any, path: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{_join(path, f.name)}: required")
            continue
        kwargs[f.name] = _coerce(hints[f.name], raw[f.name], _join(path, f.name))
    return cls(**kwargs)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, allowed))}, "
                              f"got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        # e.g. int | Literal["auto"]: the first member that takes the value.
        members = [t for t in typing.get_args(tp) if t is not type(None)]
        for member in members:
            try:
                return _coerce(member, value, path)
            except ConfigError:
                continue
        expected = " or ".join(_describe(m) for m in members)
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, repr(tp))


def _check(config: Config) -> None:
    """Cross-field and range checks that types alone cannot express."""
    e, s, w = config.edge, config.session, config.worker
    if e.edge_id and not all(c.isascii() and (c.isalnum() or c in "-_") for c in e.edge_id):
        raise ConfigError(f"edge.edge_id: only letters, digits, '-' and '_' (it is a subject "
                          f"token), got {e.edge_id!r}")
    if not 0 <= e.port <= 65535:
        raise ConfigError(f"edge.port: must be 0..65535, got {e.port}")
    if e.publish_patience < 0:
        raise ConfigError(f"edge.publish_patience: must be >= 0, got {e.publish_patience:g}")
    for name, value in (
        ("edge.max_body_bytes", e.max_body_bytes),
        ("edge.admission_timeout", e.admission_timeout),
        ("edge.queue_timeout", e.queue_timeout),
        ("edge.request_timeout", e.request_timeout),
        ("edge.max_response_bytes", e.max_response_bytes),
        ("edge.shutdown_timeout", e.shutdown_timeout),
        ("edge.slow_client_timeout", e.slow_client_timeout),
        ("edge.max_json_depth", e.max_json_depth),
        ("edge.header_timeout", e.header_timeout),
        ("edge.body_timeout", e.body_timeout),
        ("edge.idle_timeout", e.idle_timeout),
        ("edge.max_line_size", e.max_line_size),
        ("edge.max_field_size", e.max_field_size),
        ("edge.max_headers", e.max_headers),
        ("session.ack_timeout", s.ack_timeout),
        ("worker.resume_timeout", w.resume_timeout),
        ("session.window_bytes", s.window_bytes),
        ("session.window_msgs", s.window_msgs),
        ("session.heartbeat_interval", s.heartbeat_interval),
        ("session.worker_lost_after", s.worker_lost_after),
        ("nats.connect_timeout", config.nats.connect_timeout),
        ("nats.request_timeout", config.nats.request_timeout),
        ("redis.timeout", config.redis.timeout),
        ("streams.replicas", config.streams.replicas),
        ("streams.requests_max_msgs", config.streams.requests_max_msgs),
        ("streams.requests_max_bytes", config.streams.requests_max_bytes),
        ("streams.jobs_max_msgs", config.streams.jobs_max_msgs),
        ("streams.jobs_max_bytes", config.streams.jobs_max_bytes),
        ("streams.duplicate_window", config.streams.duplicate_window),
        ("streams.max_age", config.streams.max_age),
        ("streams.usage_max_age", config.streams.usage_max_age),
        ("streams.usage_max_bytes", config.streams.usage_max_bytes),
        ("dispatcher.batch", config.dispatcher.batch),
        ("dispatcher.ack_wait", config.dispatcher.ack_wait),
        ("dispatcher.fetch_timeout", config.dispatcher.fetch_timeout),
        ("worker.ack_wait", w.ack_wait),
        ("worker.max_deliver", w.max_deliver),
        ("worker.read_bytes", w.read_bytes),
        ("worker.fetch_timeout", w.fetch_timeout),
        ("worker.shutdown_timeout", w.shutdown_timeout),
        ("worker.max_response_bytes", w.max_response_bytes),
        ("routing.home_ttl", config.routing.home_ttl),
        ("routing.max_affinity_wait", config.routing.max_affinity_wait),
        ("routing.prefix_bytes", config.routing.prefix_bytes),
        ("batch.max_file_bytes", config.batch.max_file_bytes),
        ("batch.max_lines", config.batch.max_lines),
        ("batch.max_line_bytes", config.batch.max_line_bytes),
        ("batch.max_window", config.batch.max_window),
        ("batch.file_ttl", config.batch.file_ttl),
        ("batch.lease", config.batch.lease),
        ("batch.max_running", config.batch.max_running),
        ("ws.max_concurrent", config.ws.max_concurrent),
        ("ws.max_message_bytes", config.ws.max_message_bytes),
        ("ws.auth_timeout", config.ws.auth_timeout),
        ("ws.idle_before_ping", config.ws.idle_before_ping),
        ("ws.ping_interval", config.ws.ping_interval),
        ("ws.pong_timeout", config.ws.pong_timeout),
        ("ws.max_missed_pongs", config.ws.max_missed_pongs),
    ):
        _positive(name, value)
    if not 0 < config.batch.share_under_load <= 1:
        raise ConfigError(f"batch.share_under_load: must be in (0, 1] (1 = batch may fill "
                          f"every free slot), got {config.batch.share_under_load}")
    if config.dispatcher.ack_wait >= e.admission_timeout:
        raise ConfigError(f"dispatcher.ack_wait ({config.dispatcher.ack_wait:g}s) must be below "
                          f"edge.admission_timeout ({e.admission_timeout:g}s): a request held "
                          "by a dead dispatcher is redelivered only after ack_wait")
    # nats-server's default max_payload is 1 MiB: a batch must stay well under it.
    if not 0 <= w.coalesce_bytes <= 512 << 10:
        raise ConfigError(f"worker.coalesce_bytes: must be between 0 (off) and 524288, "
                          f"got {w.coalesce_bytes}")
    for name, value in (("edge.keepalive_idle", e.keepalive_idle),
                        ("edge.keepalive_interval", e.keepalive_interval),
                        ("edge.keepalive_count", e.keepalive_count)):
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0 (0 turns keepalive off), got {value}")
    if e.max_json_depth > 256:
        raise ConfigError(f"edge.max_json_depth: at most 256 (msgpack and Python recursion "
                          f"limits sit above it), got {e.max_json_depth}")
    if e.max_connections < 0 or e.max_connections_per_ip < 0:
        raise ConfigError("edge.max_connections, edge.max_connections_per_ip: must be >= 0 "
                          "(0 = no cap)")
    if bool(e.tls_cert) != bool(e.tls_key):
        raise ConfigError("edge.tls_cert and edge.tls_key: set both (HTTPS) or neither")
    # The edge last heard the dead worker up to one heartbeat before it died,
    # and JetStream redelivers up to ack_wait after the death.
    margin = s.heartbeat_interval * (s.worker_lost_after - 1)
    if w.ack_wait >= margin:
        raise ConfigError(
            f"worker.ack_wait ({w.ack_wait:g}s) must be below session.heartbeat_interval x "
            f"(session.worker_lost_after - 1) ({margin:g}s): a job whose worker died before "
            "its first chunk must be redelivered before the edge declares the worker lost")
    if e.keepalive_idle and (e.keepalive_interval < 1 or e.keepalive_count < 1):
        raise ConfigError("edge.keepalive_interval and edge.keepalive_count: must be >= 1 "
                          "when edge.keepalive_idle is set")
    if s.window_msgs < 4:
        raise ConfigError(f"session.window_msgs: must be >= 4, got {s.window_msgs}")
    if s.window_bytes < 1024:
        raise ConfigError(f"session.window_bytes: must be >= 1024, got {s.window_bytes}")
    if config.streams.replicas > 5:
        raise ConfigError(f"streams.replicas: JetStream allows at most 5, got "
                          f"{config.streams.replicas}")
    if config.logging.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"logging.level: unknown level {config.logging.level!r}")
    try:
        Subjects(config.nats.subject_prefix)
    except ValueError as exc:
        raise ConfigError(f"nats.subject_prefix: {exc}") from None
    for url_name, url, schemes in (
        ("nats.url", config.nats.url, ("nats://", "tls://", "ws://", "wss://")),
        ("redis.url", config.redis.url, ("redis://", "rediss://", "unix://",
                                         "redis+cluster://", "rediss+cluster://")),
    ):
        if not any(part.strip().startswith(schemes) for part in url.split(",")):
            raise ConfigError(f"{url_name}: expected a URL starting with "
                              f"{' or '.join(schemes)}, got {url!r}")
    r = config.resume
    for name, value in (("retention", r.retention), ("max_grace", r.max_grace),
                        ("max_stream_bytes", r.max_stream_bytes), ("max_bytes", r.max_bytes),
                        ("retry_ms", r.retry_ms), ("attach_interval", r.attach_interval)):
        _positive(f"resume.{name}", value)
    if not 0 <= r.grace <= r.max_grace:
        raise ConfigError(f"resume.grace: must be in [0, resume.max_grace], got {r.grace}")
    if not config.models:
        raise ConfigError("models: at least one [[models]] entry is required")
    names = config.model_index()
    every_replica = {r for m in config.models for r in m.replica_names if len(m.replicas) > 1}
    for i, name in enumerate(w.replicas):
        if name not in every_replica:
            raise ConfigError(f"worker.replicas[{i}]: no model has a replica named {name!r} "
                              f"(replicas: {', '.join(sorted(every_replica)) or 'none'})")
    for i, name in enumerate(w.models):
        if name not in names:
            raise ConfigError(f"worker.models[{i}]: no model or alias named {name!r} "
                              f"(configured: {', '.join(sorted(names))})")
    seen: dict[str, str] = {}
    for i, m in enumerate(config.models):
        where = f"models[{i}]"
        if not m.name:
            raise ConfigError(f"{where}.name: must not be empty")
        for name in (m.name, *m.aliases):
            if name in seen:
                raise ConfigError(f"{where}: name {name!r} is already used by model "
                                  f"{seen[name]!r}")
            seen[name] = m.name
        if m.base_url and m.base_urls:
            raise ConfigError(f"{where}: set base_url or base_urls, not both")
        if m.backend == "openai" and not m.base_urls and not m.base_url.startswith(
                ("http://", "https://")):
            raise ConfigError(f"{where}.base_url: the openai backend needs an http(s) URL, "
                              f"got {m.base_url!r}")
        for j, url in enumerate(m.base_urls):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{where}.base_urls[{j}]: expected an http(s) URL, "
                                  f"got {url!r}")
        if len(set(m.replica_names)) != len(m.replica_names):
            raise ConfigError(f"{where}.base_urls: the same replica is listed twice")
        if m.base_urls and m.backend != "openai":
            raise ConfigError(f"{where}.base_urls: replicas need backend = \"openai\"")
        if m.reserve_max_tokens < 1:
            raise ConfigError(f"{where}.reserve_max_tokens: must be >= 1, got "
                              f"{m.reserve_max_tokens}")
        if isinstance(m.max_streams, int) and m.max_streams < 1:
            raise ConfigError(f"{where}.max_streams: must be >= 1 or \"auto\", got "
                              f"{m.max_streams}")
        if m.min_streams < 1:
            raise ConfigError(f"{where}.min_streams: must be >= 1, got {m.min_streams}")
        if m.max_streams_limit < m.min_streams:
            raise ConfigError(f"{where}.max_streams_limit: must be >= min_streams "
                              f"({m.min_streams}), got {m.max_streams_limit}")
        if m.latency_tolerance <= 1.0:
            raise ConfigError(f"{where}.latency_tolerance: must be > 1 (a latency ratio over "
                              f"the uncongested baseline), got {m.latency_tolerance}")
        for name, value in (("connect_timeout", m.connect_timeout),
                            ("first_byte_timeout", m.first_byte_timeout),
                            ("idle_timeout", m.idle_timeout),
                            ("simulator.tokens_per_second", m.simulator.tokens_per_second)):
            _positive(f"{where}.{name}", value)
        q = m.queue
        if q.ttft_p99 < 0:
            raise ConfigError(f"{where}.queue.ttft_p99: must be >= 0 (0 = off), got {q.ttft_p99}")
        for name, value in (("queue.window", q.window), ("queue.enter_after", q.enter_after),
                            ("queue.exit_after", q.exit_after), ("queue.max_queued", q.max_queued),
                            ("queue.ttl", q.ttl), ("queue.min_concurrency", q.min_concurrency)):
            _positive(f"{where}.{name}", value)
        if not 0 < q.exit_ratio <= 1:
            raise ConfigError(f"{where}.queue.exit_ratio: must be in (0, 1], got {q.exit_ratio}")
        if m.simulator.ttft < 0:
            raise ConfigError(f"{where}.simulator.ttft: must be >= 0, got {m.simulator.ttft}")
        if m.simulator.prefill_per_char < 0:
            raise ConfigError(f"{where}.simulator.prefill_per_char: must be >= 0, got "
                              f"{m.simulator.prefill_per_char}")
        if m.simulator.length < 1:
            raise ConfigError(f"{where}.simulator.length: must be >= 1, got "
                              f"{m.simulator.length}")
        if not 1 <= m.simulator.embedding_dimensions <= 8192:
            raise ConfigError(f"{where}.simulator.embedding_dimensions: must be in "
                              f"[1, 8192], got {m.simulator.embedding_dimensions}")
