"""The config's shape: one frozen dataclass per TOML section, with its defaults.

:func:`tidegate.config.load` builds them; ``tidegate.config`` re-exports every
name here, so ``from tidegate.config import ModelConfig`` is the import to use.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from tidegate.wire.subjects import Subjects

BackendKind = Literal["simulator", "openai"]
FailoverMode = Literal["continue", "restart", "off"]
# What a stream whose worker dies does by default (ModelConfig.failover).
DEFAULT_FAILOVER: FailoverMode = "continue"
# A model's worker concurrency: a pinned number, or "auto" (workers.limiter).
StreamLimit = int | Literal["auto"]
StorageKind = Literal["file", "memory"]
# A model's bound on one request's output tokens when neither the config nor
# its backend (tidegate up --backend reads the context length) says otherwise.
DEFAULT_MAX_OUTPUT_TOKENS = 1 << 18
# The edge's metrics port (the OpenTelemetry Prometheus exporter's default).
DEFAULT_EDGE_METRICS_PORT = 9464
QuotaFailure = Literal["closed", "open"]
AffinityMode = Literal["auto", "off"]
# How a model's workers serve POST /v1/messages (docs/anthropic.md).
MessagesMode = Literal["auto", "translate", "passthrough"]


@dataclass(frozen=True, slots=True)
class SimulatorConfig:
    """The built-in model: deterministic text at a configurable pace."""

    ttft: float = 0.05  # seconds before the first token
    tokens_per_second: float = 50.0  # pace of the output after the first token
    length: int = 64  # tokens generated when the request sets no max_tokens
    embedding_dimensions: int = 256  # vector size when an embeddings request sets none
    # A prefix-cache model (docs/routing.md): the first token also waits this
    # many seconds per prompt character this worker's cache did not hold.
    prefill_per_char: float = 0.0
    # Token i is a function of (prompt, i) and a trailing assistant message is
    # continued (workers/backends/greedy.py): byte-exact continuation checks.
    deterministic: bool = False
    # Test only (workers/backends/simulator_tools.py): a chat, Messages or
    # Responses request that lists a tool of this name, its last turn not a
    # tool's result, is answered with a call of it, these arguments (a JSON object).
    tool_call: str = ""
    tool_arguments: str = "{}"  # test only: that call's arguments, a JSON object as text


@dataclass(frozen=True, slots=True)
class QueueModeConfig:
    """When a model's backend gets slow, admit only what it handled well and
    queue the rest fairly (see docs/queue-mode.md). Off while ``ttft_p99`` is 0."""

    ttft_p99: float = 0.0  # seconds; P99 TTFT above this is a bad window (0 = never queue)
    window: float = 10.0  # seconds per measurement window
    enter_after: int = 3  # consecutive bad windows before queue mode
    exit_after: int = 3  # consecutive good windows before leaving it
    exit_ratio: float = 0.7  # a good window in queue mode has P99 below ttft_p99 x this
    # Hard bound; past it, 503 + Retry-After, unless a lower class waits: then
    # the newest request of the lowest class gives up its place (503 too).
    max_queued: int = 1000
    ttl: float = 60.0  # an interactive request waits at most this long, then 503
    # A background response or a batch line waits longer (but never past the
    # request's deadline, edge.queue_timeout after it came); a batch line retries.
    background_ttl: float = 240.0
    batch_ttl: float = 240.0  # the same for a batch line
    # An interactive request dispatched while every slot of the model is
    # taken, still waiting this many seconds later, takes one from a batch
    # line, a background response or a lighter tier's stream, which runs
    # again or is continued later (docs/priorities.md#preemption). 0: never.
    # Queue mode or not. The wait adds to the TTFT of every request that finds
    # the slots held: 0.1 s keeps a burst within 1.2x of an idle backend's
    # (docs/benchmarks.md, priorities).
    preempt_after: float = 0.1
    # Times one job may be handed back; never more than
    # worker.max_deliver - 2 (each hand-back is a delivery).
    max_preemptions: int = 2
    min_concurrency: int = 1  # admission floor while in queue mode

    def ttl_for(self, klass: str) -> float:
        """How long a request of ``klass`` (tidegate.wire.classes) may wait."""
        return {"background": self.background_ttl, "batch": self.batch_ttl}.get(klass, self.ttl)


@dataclass(frozen=True, slots=True)
class TierConfig:
    """A tier of tenants: the share of a saturated model's tokens each of its
    tenants gets beside other tenants of one class, and whose streams give
    way to whose (docs/priorities.md)."""

    name: str  # (required) unique
    weight: float = 1.0  # tokens per turn against a tenant of weight 1 (no tier's weight)
    tenants: tuple[str, ...] = ()  # its tenants; a tenant of no tier has weight 1


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One model that clients can name, and how workers reach it."""

    name: str  # the name clients send as "model" (required)
    backend: BackendKind = "simulator"  # "openai": any OpenAI-compatible server at base_url
    aliases: tuple[str, ...] = ()  # more names clients may use for this model
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
    connect_timeout: float = 10.0  # seconds to open a connection to the backend
    first_byte_timeout: float = 300.0  # backend silence before its first byte
    idle_timeout: float = 120.0  # backend silence between two chunks
    # Tokens reserved against quotas for the completion when the request sets
    # no max_tokens (the prompt is estimated separately); actual usage
    # reconciles the reservation afterwards.
    reserve_max_tokens: int = 1024
    # The largest max_tokens / max_completion_tokens / max_output_tokens a
    # request may ask for; above it the edge answers 400 invalid_value. Every
    # per-request allocation sized by the limit (the simulator's plan, quota
    # reservations) is bounded by it.
    max_output_tokens: int = DEFAULT_MAX_OUTPUT_TOKENS
    simulator: SimulatorConfig = field(default_factory=SimulatorConfig)
    queue: QueueModeConfig = field(default_factory=QueueModeConfig)
    # Every streaming request for this model is resumable (docs/resume.md).
    resumable: bool = False
    # POST /v1/messages (Anthropic's API, docs/anthropic.md): "passthrough"
    # relays it to the backend's own /v1/messages; "translate" turns it into
    # a chat completion and the chunks back into Anthropic's events; "auto"
    # tries passthrough and falls back to translate, for good, once the
    # backend answers that it lacks the endpoint. The simulator translates.
    messages: MessagesMode = "auto"
    # Prices in spend.currency (docs/spend.md): per million input, cached
    # input and output tokens, and per request. price_cached_input < 0 means
    # "the input price". The KV bucket <P>_PRICES overrides them per model.
    price_input: float = 0.0
    price_cached_input: float = -1.0  # per million cached input tokens
    price_output: float = 0.0  # per million output tokens
    price_request: float = 0.0  # per request, whatever its tokens
    # A worker that dies mid-request (docs/resume.md, "Continuation"):
    # "continue" (the default) - its job runs again elsewhere, continuing the
    # delivered text; "restart" - a job with no output yet runs again, one
    # with output ends with worker_lost; "off" - worker_lost either way,
    # nothing runs again.
    failover: FailoverMode = DEFAULT_FAILOVER

    def __post_init__(self) -> None:
        if self.max_streams is None:  # the backend's default (see max_streams)
            object.__setattr__(self, "max_streams",
                               "auto" if self.backend == "openai" else 64)
        # One replica is no replica set: base_urls = [u] is base_url = u, so
        # every consumer (the worker's backend above all) finds the one URL
        # where a single-backend model keeps it. Anything the check refuses
        # (base_url set too, a bad URL, not openai) stays as written, so its
        # message names the key the user wrote.
        if (len(self.base_urls) == 1 and not self.base_url and self.backend == "openai"
                and is_http_url(self.base_urls[0])):
            object.__setattr__(self, "base_url", self.base_urls[0])
            object.__setattr__(self, "base_urls", ())

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


def is_http_url(url: str) -> bool:
    """Whether the worker's HTTP client can connect to ``url``: http or https,
    a host, a port in range (workers.backends.http1.Http1Pool)."""
    try:
        parts = urlsplit(url)
        return parts.scheme in ("http", "https") and bool(parts.hostname) and (
            parts.port is None or parts.port > 0)  # .port raises past 65535
    except ValueError:
        return False


def replica_name(url: str) -> str:
    return url.split("://", 1)[-1].rstrip("/")


@dataclass(frozen=True, slots=True)
class EdgeConfig:
    """The HTTP front door: listen address, limits, timeouts, drain, metrics port."""

    host: str = "127.0.0.1"  # listen address; 0.0.0.0 to accept remote connections
    port: int = 8080  # the API port (HTTP, SSE, WebSocket)
    edge_id: str = ""  # unique per process; generated when empty
    max_body_bytes: int = 32 << 20  # larger request bodies get 413
    # A request whose envelope is larger than this crosses the broker by
    # claim check: its body goes to the <P>_BODIES object store and the
    # message carries its name (tidegate.broker.bodies). 0: half the
    # broker's max_payload (512 KiB on nats-server's default 1 MiB).
    claim_check_bytes: int = 0
    admission_timeout: float = 30.0  # no dispatcher answer within this: 503
    # A request publish that gets no PubAck (a NATS node died, a leader
    # election) is retried for this long before 503 broker_unavailable; the
    # Nats-Msg-Id dedup makes the retry safe. 0: answer 503 at once. Capped
    # at half of admission_timeout, so the dispatcher still has time after it.
    # 15 s: a stream's followers wait 4-9 s for a dead leader before they
    # elect another (nats-server's raft election timeout, not configurable),
    # plus the client's reconnect; 10 s left too little on a busy machine.
    publish_patience: float = 15.0
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
    keepalive_interval: int = 10  # seconds between keepalive probes
    keepalive_count: int = 6  # unanswered probes before the kernel drops the connection
    # SO_REUSEPORT on the listening socket: several edge processes on one host
    # share one port and the kernel spreads connections across them.
    reuse_port: bool = False
    # -- hostile-client limits (docs/security.md) --
    max_json_depth: int = 64  # deeper JSON bodies get 400 invalid_json
    header_timeout: float = 10.0  # first request's headers must arrive within this (slowloris)
    body_timeout: float = 30.0  # the whole body must arrive within this, else 408
    # body_timeout grows by one second per this many bytes received (uploads),
    # so a large honest body keeps earning time and a trickle does not (edge/body.py).
    body_min_rate: float = 16384.0
    idle_timeout: float = 75.0  # an idle kept-alive connection is closed after this
    max_line_size: int = 8190  # request line bytes
    max_field_size: int = 8190  # bytes of one header line
    max_headers: int = 100  # header lines per request
    max_connections: int = 20_000  # open client connections per edge (0 = no cap)
    max_connections_per_ip: int = 1_000  # open connections per client address (0 = no cap)
    # HTTPS: PEM certificate chain and key; both empty = plain HTTP.
    tls_cert: str = ""
    tls_key: str = ""  # PEM private key of tls_cert
    # GET /metrics is served without a key, so not on the API port: on a port
    # of its own (with GET /healthz), bound to metrics_host. 0 = no metrics
    # server. $TIDEGATE_METRICS_PORT / $TIDEGATE_METRICS_HOST, when set, win
    # (tidegate up gives each edge its own). metrics_public: also serve
    # /metrics on the API port, keyless, as before (opt-in).
    metrics_host: str = "127.0.0.1"
    metrics_port: int = DEFAULT_EDGE_METRICS_PORT  # the metrics server's port
    metrics_public: bool = False  # also serve /metrics on the API port, keyless
    # The gRPC ingress (docs/grpc.md) listens on this port of ``host``, with
    # the same TLS; 0 = no gRPC server (the default; `tidegate up` turns it on).
    grpc_port: int = 0


@dataclass(frozen=True, slots=True)
class GrpcConfig:
    """The gRPC ingress's limits and HTTP/2 connection management (docs/grpc.md)."""

    # Largest request message; a bigger one fails with RESOURCE_EXHAUSTED
    # before it is parsed. 0 = edge.max_body_bytes plus room for the envelope.
    max_message_bytes: int = 0
    max_concurrent: int = 16  # generations at once per Session call
    max_concurrent_streams: int = 256  # HTTP/2 streams (calls) at once per connection
    max_metadata_bytes: int = 8192  # all request metadata of one call
    # Server keepalive: a PING after keepalive_time seconds without traffic;
    # no answer within keepalive_timeout closes the connection (its calls'
    # work upstream is cancelled, as for a dropped socket). Client pings more
    # often than min_ping_interval are refused (GOAWAY too_many_pings).
    keepalive_time: float = 30.0
    keepalive_timeout: float = 20.0  # a keepalive PING unanswered this long closes
    min_ping_interval: float = 10.0  # client pings more often than this are refused
    # A connection lives at most max_connection_age seconds (then GOAWAY, so
    # clients rebalance across edges), its calls get max_connection_age_grace
    # more to finish; an idle one closes after max_connection_idle. 0 = never.
    max_connection_age: float = 0.0
    max_connection_age_grace: float = 0.0  # 0: edge.shutdown_timeout
    max_connection_idle: float = 0.0  # a connection with no call this long is closed


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
    ping_interval: float = 20.0  # between pings while the socket stays idle
    pong_timeout: float = 20.0  # a ping unanswered this long is one miss
    max_missed_pongs: int = 2  # misses in a row before the socket is closed (1011)
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
    # How often an edge asks NATS whether each worker its streams follow is
    # still subscribed (tidegate.broker.liveness): a killed worker is known dead within
    # about this plus a round trip. 0 turns the probe off (heartbeats only).
    liveness_interval: float = 0.2
    # A worker with output unacknowledged for this long takes the edge (or its
    # client) as gone and cancels the backend. Above edge.slow_client_timeout,
    # so a slow client is handled by its edge, with a clear error, first.
    ack_timeout: float = 40.0


@dataclass(frozen=True, slots=True)
class NatsConfig:
    """The broker every tier connects to."""

    url: str = "nats://127.0.0.1:4222"  # several servers of a cluster: comma-separated
    subject_prefix: str = "tg"  # of every subject and, upper-cased, every stream name
    connect_timeout: float = 5.0  # one connection attempt; tiers retry forever
    request_timeout: float = 5.0  # JetStream publish / API calls
    # Every client PINGs its server this often; with max_pings_out PINGs
    # unanswered the link is stale: the client drops it and reconnects, and a
    # worker fences itself, an edge releases its clients (docs/reliability.md,
    # "Partitions"). Bound on noticing a silent cut: ping_interval x
    # (max_pings_out + 1).
    ping_interval: float = 1.0
    max_pings_out: int = 2  # unanswered PINGs before the link is stale
    # Per-tier login written by `tidegate nats-config` (a TOML file: user,
    # password, inbox_prefix); "{tier}" is replaced by the connecting tier's
    # name (edge, dispatcher, worker, admin). Empty: connect without auth.
    credentials: str = ""
    # TLS to NATS: CA bundle to verify the server, optional client cert + key.
    # A tls:// URL or tls_ca turns TLS on.
    tls_ca: str = ""
    tls_cert: str = ""  # client certificate, when the server asks for one
    tls_key: str = ""  # the client certificate's private key

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.subject_prefix)


@dataclass(frozen=True, slots=True)
class RedisConfig:
    """The quota store, for dispatchers only (quotas, budgets, queue mode)."""

    url: str = "redis://127.0.0.1:6379/0"  # a Redis Cluster: redis+cluster://h:p,h:p
    timeout: float = 2.0  # connect and command timeout of every Redis call


@dataclass(frozen=True, slots=True)
class StreamsConfig:
    """JetStream stream limits. A full requests stream is load shedding: 503."""

    replicas: int = 1  # copies of every stream in a NATS cluster (at most 5)
    storage: StorageKind = "file"  # "memory": faster, lost when a NATS server restarts
    requests_max_msgs: int = 100_000  # TG_REQUESTS bound; past it, 503 overloaded
    requests_max_bytes: int = 1 << 30  # TG_REQUESTS bound in bytes
    jobs_max_msgs: int = 100_000  # TG_JOBS bound
    jobs_max_bytes: int = 1 << 30  # TG_JOBS bound in bytes
    duplicate_window: float = 120.0  # Nats-Msg-Id dedup window, seconds
    max_age: float = 3600.0  # a request older than this is useless to anyone
    usage_max_age: float = 86400.0  # usage records are kept this long for billing consumers
    usage_max_bytes: int = 1 << 30  # TG_USAGE bound; the oldest records go first
    # Who owns each Responses API response id (about 200 bytes each), so that
    # only its tenant may name it in previous_response_id; OpenAI keeps
    # responses this long. Past it the id answers 404.
    responses_max_age: float = 30 * 86400.0


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """Admission: quotas, queue mode, job publication."""

    batch: int = 64  # requests pulled per fetch
    # Redis (quota store) unreachable: "closed" rejects with 503 (no request
    # runs unmetered), "open" admits without quotas. Either way it is logged.
    quota_failure: QuotaFailure = "closed"
    # Redelivery delay when a dispatcher dies holding a request. Dispatching takes
    # milliseconds, so this can be short; it must stay well below
    # edge.admission_timeout or clients time out just as their request is retried.
    ack_wait: float = 10.0
    fetch_timeout: float = 1.0  # pull request expiry, seconds


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Backend calls: pulling jobs, streaming output back, drain."""

    # JetStream redelivers a job after this without progress (in-progress acks
    # go every third of it). Below heartbeat_interval x (worker_lost_after - 1)
    # so a job whose worker died before its first chunk restarts elsewhere
    # before its edge gives up.
    ack_wait: float = 20.0
    max_deliver: int = 5  # deliveries of one job before it is given up
    read_bytes: int = 16 << 10  # largest chunk message (whole SSE events) to the edge
    # Messages to one edge within one loop iteration go as one NATS message of
    # at most this many bytes (tidegate.mux); 0 = one NATS message each.
    coalesce_bytes: int = 128 << 10
    # The first message of such a batch waits up to this long (seconds) for
    # others to join it: fewer NATS messages and edge wake-ups per chunk at
    # moderate load, for at most this much added latency per chunk (measured:
    # 2 ms cut CPU per chunk by 20 % at 50 streams, docs/benchmarks.md).
    coalesce_delay: float = 0.002
    # Pull request expiry. A dead worker's pull requests stay on the server
    # until they expire, and the liveness probe confirms its death only after
    # that (tidegate.broker.liveness.PULL_MARGIN): kept below CONFIRM_AFTER.
    fetch_timeout: float = 0.5
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

    affinity: AffinityMode = "auto"  # "off": every job goes to the shared queue
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
    # All of one tenant's files together (uploads and batch outputs); an upload
    # past it gets 413 storage_quota_exceeded. 0 = no quota.
    tenant_storage_bytes: int = 1 << 30
    max_lines: int = 50_000  # requests per batch input file
    # One input line; past half of NATS' max_payload a line's body crosses by
    # claim check (tidegate.broker.bodies), as a request's does at the edge.
    max_line_bytes: int = 32 << 20
    max_retries: int = 3  # transient failures (5xx, worker lost) retried per line first
    max_window: float = 86400.0  # longest completion_window accepted, seconds ("24h")
    file_ttl: float = 30 * 86400.0  # files (inputs and results) are kept this long
    lease: float = 3.0  # the batch runner's leadership lease; a dead runner's successor waits this
    max_running: int = 512  # batch lines in flight at once, whatever the free slots say
    # While interactive jobs run on a model, batch holds at most this share of
    # the slots they leave free (rounded up); with none running, every free slot.
    share_under_load: float = 0.05


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
class SpendConfig:
    """Money: the currency prices and budgets are in, and the calendar of
    budget periods (docs/spend.md)."""

    currency: str = "USD"  # named once; every price and budget is in it
    timezone: str = "UTC"  # IANA name; day / week / month budgets start at its midnight
    # Fractions of a budget at which a metric and a log line alert (soft and hard budgets).
    alert_at: tuple[float, ...] = (0.8, 1.0)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Keys from the config (keys in NATS KV: tidegate keys, docs/keys-and-policies.md)."""

    keys: tuple[str, ...] = ()  # static API keys, tenant "default"
    dev_key: str = ""  # one more static key; tidegate up writes one to its data dir


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    """Every tier's log lines, on stderr."""

    level: str = "INFO"  # DEBUG, INFO, WARNING, ERROR or CRITICAL
    json: bool = False  # one JSON object per line instead of plain text


@dataclass(frozen=True, slots=True)
class Config:
    """The whole config: one TOML file, a table per section."""

    edge: EdgeConfig = field(default_factory=EdgeConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    ws: WsConfig = field(default_factory=WsConfig)
    grpc: GrpcConfig = field(default_factory=GrpcConfig)
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
    spend: SpendConfig = field(default_factory=SpendConfig)
    models: tuple[ModelConfig, ...] = (ModelConfig(name="tidegate-sim", aliases=("sim",)),)
    tiers: tuple[TierConfig, ...] = ()

    def tier_of(self, tenant: str) -> TierConfig | None:
        """The tier ``tenant`` is in (None: none, weight 1)."""
        return next((t for t in self.tiers if tenant in t.tenants), None)

    def model_index(self) -> dict[str, ModelConfig]:
        """Every name a client may use (names and aliases) -> its model."""
        index: dict[str, ModelConfig] = {}
        for model in self.models:
            for name in (model.name, *model.aliases):
                index[name] = model
        return index

    def api_keys(self) -> tuple[str, ...]:
        return (*self.auth.keys, self.auth.dev_key) if self.auth.dev_key else self.auth.keys
