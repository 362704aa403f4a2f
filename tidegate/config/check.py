"""The config's validation: range and cross-field checks that types alone
cannot express, each message naming the key (run by :func:`tidegate.config.from_dict`)."""

from __future__ import annotations

import ipaddress
import json
import re
import zoneinfo

from tidegate.config.sections import Config, is_http_url
from tidegate.errors import ConfigError
from tidegate.wire.subjects import Subjects


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be > 0, got {value!r}")


# One DNS label (RFC 1123, plus "_" as container names use it).
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def _host(name: str, host: str) -> None:
    """An address to listen on: an IP address or a host name ("" = every interface)."""
    if not host:
        return
    try:
        ipaddress.ip_address(host)
        return
    except ValueError:
        pass
    if len(host) > 253 or not all(_LABEL.fullmatch(label)
                                  for label in host.removesuffix(".").split(".")):
        raise ConfigError(f"{name}: an IP address or a host name (\"\" = every interface), "
                          f"got {host!r}")


def _api_key(name: str, key: str) -> None:
    # A key a client could never send (a Bearer token is one printable ASCII
    # word) is a typo; an empty one would match an empty Authorization header.
    if not key or not (key.isascii() and key.isprintable()) or " " in key:
        raise ConfigError(f"{name}: an API key is one word of printable ASCII, got {key!r}")


def _http_url(name: str, url: str) -> None:
    if not is_http_url(url):
        raise ConfigError(f"{name}: expected an http(s) URL with a host, such as "
                          f"\"http://127.0.0.1:8000/v1\", got {url!r}")


def check_values(config: Config) -> None:
    """Cross-field and range checks that types alone cannot express."""
    e, s, w = config.edge, config.session, config.worker
    if e.edge_id and not all(c.isascii() and (c.isalnum() or c in "-_") for c in e.edge_id):
        raise ConfigError(f"edge.edge_id: only letters, digits, '-' and '_' (it is a subject "
                          f"token), got {e.edge_id!r}")
    if not 0 <= e.port <= 65535:
        raise ConfigError(f"edge.port: must be 0..65535, got {e.port}")
    if not 0 <= e.metrics_port <= 65535:
        raise ConfigError(f"edge.metrics_port: must be 0..65535 (0 = none), got "
                          f"{e.metrics_port}")
    if e.metrics_port and e.metrics_port == e.port:
        raise ConfigError(f"edge.metrics_port: {e.metrics_port} is edge.port; /metrics goes "
                          "on a port of its own (or set edge.metrics_public)")
    if e.publish_patience < 0:
        raise ConfigError(f"edge.publish_patience: must be >= 0, got {e.publish_patience:g}")
    if e.body_min_rate < 0:
        raise ConfigError(f"edge.body_min_rate: must be >= 0 (0 = body_timeout only), got "
                          f"{e.body_min_rate:g}")
    if e.claim_check_bytes < 0:
        raise ConfigError(f"edge.claim_check_bytes: must be >= 0 (0 = half the broker's "
                          f"max_payload), got {e.claim_check_bytes}")
    if config.batch.tenant_storage_bytes < 0:
        raise ConfigError(f"batch.tenant_storage_bytes: must be >= 0 (0 = no quota), got "
                          f"{config.batch.tenant_storage_bytes}")
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
        ("nats.ping_interval", config.nats.ping_interval),
        ("nats.max_pings_out", config.nats.max_pings_out),
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
        ("streams.responses_max_age", config.streams.responses_max_age),
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
        ("grpc.max_concurrent", config.grpc.max_concurrent),
        ("grpc.max_concurrent_streams", config.grpc.max_concurrent_streams),
        ("grpc.max_metadata_bytes", config.grpc.max_metadata_bytes),
        ("grpc.keepalive_time", config.grpc.keepalive_time),
        ("grpc.keepalive_timeout", config.grpc.keepalive_timeout),
        ("grpc.min_ping_interval", config.grpc.min_ping_interval),
    ):
        _positive(name, value)
    g = config.grpc
    for name, value in (("grpc.max_message_bytes", g.max_message_bytes),
                        ("grpc.max_connection_age", g.max_connection_age),
                        ("grpc.max_connection_age_grace", g.max_connection_age_grace),
                        ("grpc.max_connection_idle", g.max_connection_idle)):
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0 (0 = the default, off), got {value}")
    if not 0 <= e.grpc_port <= 65535 or (e.grpc_port and e.grpc_port == e.port):
        raise ConfigError(f"edge.grpc_port: 0 (off) or a port other than edge.port, "
                          f"got {e.grpc_port}")
    if s.liveness_interval < 0:
        raise ConfigError("session.liveness_interval: must be >= 0 (0 turns the worker "
                          "liveness probe off)")
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
    if not 0 <= w.coalesce_delay <= 0.1:
        raise ConfigError(f"worker.coalesce_delay: must be between 0 (off) and 0.1 s: it is "
                          f"added to every token's latency, got {w.coalesce_delay:g}")
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
    _host("edge.host", e.host)
    _host("edge.metrics_host", e.metrics_host)
    for i, key in enumerate(config.auth.keys):
        _api_key(f"auth.keys[{i}]", key)
    if config.auth.dev_key:
        _api_key("auth.dev_key", config.auth.dev_key)
    if config.batch.max_retries < 0:
        raise ConfigError(f"batch.max_retries: must be >= 0 (0 = no retry), got "
                          f"{config.batch.max_retries}")
    n = config.nats
    if n.tls_key and not n.tls_cert:
        raise ConfigError("nats.tls_key: set only with nats.tls_cert (the client certificate)")
    # tidegate.broker.auth.tls_context turns TLS on only for these; a client
    # certificate without them would be silently left out of the handshake.
    if n.tls_cert and not (n.tls_ca or n.url.strip().startswith("tls://")):
        raise ConfigError("nats.tls_cert: a client certificate needs TLS on (a tls:// "
                          "nats.url, or nats.tls_ca)")
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
    _check_spend(config)
    _check_tiers(config)
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
        for j, alias in enumerate(m.aliases):
            if not alias:
                raise ConfigError(f"{where}.aliases[{j}]: must not be empty")
        for name in (m.name, *m.aliases):
            if name in seen:
                raise ConfigError(f"{where}: name {name!r} is already used by model "
                                  f"{seen[name]!r}")
            seen[name] = m.name
        if m.base_url and m.base_urls:
            raise ConfigError(f"{where}: set base_url or base_urls, not both")
        if m.backend == "openai" and not m.base_urls:
            if not m.base_url:
                raise ConfigError(f"{where}.base_url: the openai backend needs an http(s) URL "
                                  f"(base_url, or base_urls for several replicas)")
            _http_url(f"{where}.base_url", m.base_url)
        for j, url in enumerate(m.base_urls):
            _http_url(f"{where}.base_urls[{j}]", url)
        if len(set(m.replica_names)) != len(m.replica_names):
            raise ConfigError(f"{where}.base_urls: the same replica is listed twice")
        if m.failover not in ("continue", "restart", "off"):
            raise ConfigError(f"{where}.failover: one of \"continue\", \"restart\", "
                              f"\"off\", got {m.failover!r}")
        if m.base_urls and m.backend != "openai":
            raise ConfigError(f"{where}.base_urls: backend URLs need backend = \"openai\"")
        if m.max_output_tokens < 1:
            raise ConfigError(f"{where}.max_output_tokens: must be >= 1, got "
                              f"{m.max_output_tokens}")
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
                            ("queue.ttl", q.ttl), ("queue.background_ttl", q.background_ttl),
                            ("queue.batch_ttl", q.batch_ttl),
                            ("queue.min_concurrency", q.min_concurrency)):
            _positive(f"{where}.{name}", value)
        if q.preempt_after < 0:
            raise ConfigError(f"{where}.queue.preempt_after: must be >= 0 (0 = never), got "
                              f"{q.preempt_after}")
        if not 0 <= q.max_preemptions <= 10:
            raise ConfigError(f"{where}.queue.max_preemptions: must be in [0, 10], got "
                              f"{q.max_preemptions}")
        if not 0 < q.exit_ratio <= 1:
            raise ConfigError(f"{where}.queue.exit_ratio: must be in (0, 1], got {q.exit_ratio}")
        if m.simulator.ttft < 0:
            raise ConfigError(f"{where}.simulator.ttft: must be >= 0, got {m.simulator.ttft}")
        if m.simulator.prefill_per_char < 0:
            raise ConfigError(f"{where}.simulator.prefill_per_char: must be >= 0, got "
                              f"{m.simulator.prefill_per_char}")
        for name, value in (("price_input", m.price_input), ("price_output", m.price_output),
                            ("price_request", m.price_request)):
            if not 0 <= value <= 1_000_000:
                raise ConfigError(f"{where}.{name}: must be in [0, 1000000], got {value!r}")
        if m.price_cached_input > 1_000_000:
            raise ConfigError(f"{where}.price_cached_input: must be <= 1000000 (< 0 = the "
                              f"input price), got {m.price_cached_input!r}")
        if m.simulator.length < 1:
            raise ConfigError(f"{where}.simulator.length: must be >= 1, got "
                              f"{m.simulator.length}")
        if not 1 <= m.simulator.embedding_dimensions <= 8192:
            raise ConfigError(f"{where}.simulator.embedding_dimensions: must be in "
                              f"[1, 8192], got {m.simulator.embedding_dimensions}")
        try:
            arguments = json.loads(m.simulator.tool_arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise ConfigError(f"{where}.simulator.tool_arguments: must be a JSON object, got "
                              f"{m.simulator.tool_arguments[:80]!r}")


def _check_tiers(config: Config) -> None:
    seen: dict[str, str] = {}
    names: set[str] = set()
    for i, tier in enumerate(config.tiers):
        where = f"tiers[{i}]"
        if not tier.name or tier.name in names:
            raise ConfigError(f"{where}.name: must be a name no other tier has, got "
                              f"{tier.name!r}")
        names.add(tier.name)
        if not 0 < tier.weight <= 1000:
            raise ConfigError(f"{where}.weight: must be in (0, 1000], got {tier.weight}")
        for tenant in tier.tenants:
            if not tenant or tenant in seen:
                raise ConfigError(f"{where}.tenants: {tenant!r} is "
                                  + (f"in tier {seen[tenant]!r} too" if tenant else "empty"))
            seen[tenant] = tier.name


def _check_spend(config: Config) -> None:
    sp = config.spend
    if not sp.currency.strip() or len(sp.currency) > 16 or not sp.currency.isprintable():
        raise ConfigError(f"spend.currency: a short name such as \"USD\", got {sp.currency!r}")
    try:
        zoneinfo.ZoneInfo(sp.timezone)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        raise ConfigError(f"spend.timezone: not a time zone name (IANA, e.g. "
                          f"\"Europe/Paris\"), got {sp.timezone!r}") from None
    for i, ratio in enumerate(sp.alert_at):
        if not 0 < ratio <= 10:
            raise ConfigError(f"spend.alert_at[{i}]: a fraction of the budget in (0, 10], "
                              f"got {ratio!r}")
