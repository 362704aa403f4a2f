"""The config schema walked key by key: every key refuses a bad value at start.

Keys are enumerated from the dataclasses (``tidegate.config.schema.walk``,
through every section and into ``models[0]``), so a key added without a check
fails :func:`test_every_key_has_a_bad_value`: give it one in ``BAD`` (what the
check refuses), or, when every value of its type is valid, a reason in
``ANY_VALUE``. Each bad value goes through the file (``load``'s overrides, as
TOML would give them), and for section keys through ``TIDEGATE__S__K`` too,
then through every tier's :func:`~fleet.run.preflight.preflight`; exactly
one line naming the key must come out. The good half, that the defaults
serve requests, is every pipeline test; tests/test_config_start.py adds the
one-element ``base_urls``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest

from fleet.run.preflight import preflight
from tidegate import config as tgconfig
from tidegate.config import Config, ModelConfig, TierConfig, schema
from tidegate.errors import ConfigError

pytestmark = pytest.mark.usefixtures("clean_env")

TIERS = ("edge", "dispatcher", "worker")
MISSING = "/nonexistent/tidegate-schema-walk"


@dataclasses.dataclass(frozen=True)
class Bad:
    """A bad value for a key, with the other keys it is bad beside."""

    value: Any
    context: dict[str, Any] = dataclasses.field(default_factory=dict)
    good: Any = None  # accepted beside the same context; None: the key's default


OPENAI = {"backend": "openai", "base_url": "http://127.0.0.1:8000/v1"}
TLS = {"nats": {"url": "tls://127.0.0.1:4222"}}

# Out of range or ill-formed: what the type lets through and the check must not.
BAD: dict[str, Any] = {
    "edge.host": "not a host!", "edge.port": 65536, "edge.edge_id": "a.b",
    "edge.max_body_bytes": 0, "edge.claim_check_bytes": -1, "edge.admission_timeout": 0.0,
    "edge.publish_patience": -1.0,
    "edge.queue_timeout": 0.0, "edge.request_timeout": 0.0, "edge.max_response_bytes": 0,
    "edge.shutdown_timeout": 0.0, "edge.slow_client_timeout": 0.0, "edge.keepalive_idle": -1,
    "edge.keepalive_interval": 0, "edge.keepalive_count": 0, "edge.max_json_depth": 257,
    "edge.header_timeout": 0.0, "edge.body_timeout": 0.0, "edge.body_min_rate": -1.0,
    "edge.idle_timeout": 0.0, "edge.max_line_size": 0, "edge.max_field_size": 0,
    "edge.max_headers": 0, "edge.max_connections": -1, "edge.max_connections_per_ip": -1,
    "edge.tls_cert": f"{MISSING}/cert.pem", "edge.tls_key": f"{MISSING}/key.pem",
    "edge.metrics_host": "not a host!", "edge.metrics_port": 65536, "edge.grpc_port": -1,
    "session.window_bytes": 1023, "session.window_msgs": 3, "session.heartbeat_interval": 0.0,
    "session.worker_lost_after": 0, "session.liveness_interval": -1.0,
    "session.ack_timeout": 0.0,
    "ws.max_concurrent": 0, "ws.max_message_bytes": 0, "ws.auth_timeout": 0.0,
    "ws.idle_before_ping": 0.0, "ws.ping_interval": 0.0, "ws.pong_timeout": 0.0,
    "ws.max_missed_pongs": 0,
    "grpc.max_message_bytes": -1, "grpc.max_concurrent": 0, "grpc.max_concurrent_streams": 0,
    "grpc.max_metadata_bytes": 0, "grpc.keepalive_time": 0.0, "grpc.keepalive_timeout": 0.0,
    "grpc.min_ping_interval": 0.0, "grpc.max_connection_age": -1.0,
    "grpc.max_connection_age_grace": -1.0, "grpc.max_connection_idle": -1.0,
    "nats.url": "http://127.0.0.1:4222", "nats.subject_prefix": "a.b",
    "nats.connect_timeout": 0.0, "nats.request_timeout": 0.0, "nats.ping_interval": 0.0,
    "nats.max_pings_out": 0, "nats.credentials": f"{MISSING}/{{tier}}.creds.toml",
    "nats.tls_ca": f"{MISSING}/ca.pem",
    "nats.tls_cert": Bad(f"{MISSING}/cert.pem", TLS),
    "nats.tls_key": f"{MISSING}/key.pem",
    "redis.url": "http://127.0.0.1:6379", "redis.timeout": 0.0,
    "streams.replicas": 6, "streams.requests_max_msgs": 0, "streams.requests_max_bytes": 0,
    "streams.jobs_max_msgs": 0, "streams.jobs_max_bytes": 0, "streams.duplicate_window": 0.0,
    "streams.max_age": 0.0, "streams.usage_max_age": 0.0, "streams.usage_max_bytes": 0,
    "streams.responses_max_age": 0.0,
    "dispatcher.batch": 0, "dispatcher.ack_wait": 30.0, "dispatcher.fetch_timeout": 0.0,
    "worker.ack_wait": 30.0, "worker.max_deliver": 0, "worker.read_bytes": 0,
    "worker.coalesce_bytes": (512 << 10) + 1, "worker.coalesce_delay": 0.2,
    "worker.fetch_timeout": 0.0, "worker.shutdown_timeout": 0.0,
    "worker.max_response_bytes": 0, "worker.models": ["no-such-model"],
    "worker.replicas": ["no-such-replica"], "worker.resume_timeout": 0.0,
    "routing.home_ttl": 0.0, "routing.max_affinity_wait": 0.0, "routing.prefix_bytes": 0,
    "auth.keys": ["two words"], "auth.dev_key": "two words",
    "batch.max_file_bytes": 0, "batch.tenant_storage_bytes": -1, "batch.max_lines": 0,
    "batch.max_line_bytes": 0, "batch.max_retries": -1, "batch.max_window": 0.0,
    "batch.file_ttl": 0.0, "batch.lease": 0.0, "batch.max_running": 0,
    "batch.share_under_load": 1.5,
    "logging.level": "LOUD",
    "resume.retention": 0.0, "resume.grace": 301.0, "resume.max_grace": 0.0,
    "resume.max_stream_bytes": 0, "resume.max_bytes": 0, "resume.retry_ms": 0,
    "resume.attach_interval": 0.0,
    "spend.currency": "", "spend.timezone": "Mars/Olympus", "spend.alert_at": [0.0],
    "models[0].name": "", "models[0].aliases": [""],
    "models[0].base_url": Bad("http://", {"models": [{"backend": "openai"}]},
                              good="http://127.0.0.1:8000/v1"),
    "models[0].base_urls": Bad(["http://:8000/v1"], {"models": [{"backend": "openai"}]},
                               good=["http://127.0.0.1:8000/v1"]),
    "models[0].api_key_env": Bad("TIDEGATE_SCHEMA_WALK_UNSET_KEY", {"models": [OPENAI]}),
    "models[0].max_streams": 0, "models[0].min_streams": 0,
    "models[0].max_streams_limit": 3, "models[0].latency_tolerance": 1.0,
    "models[0].connect_timeout": 0.0, "models[0].first_byte_timeout": 0.0,
    "models[0].idle_timeout": 0.0, "models[0].reserve_max_tokens": 0,
    "models[0].max_output_tokens": 0,
    "models[0].simulator.ttft": -1.0, "models[0].simulator.tokens_per_second": 0.0,
    "models[0].simulator.length": 0, "models[0].simulator.embedding_dimensions": 8193,
    "models[0].simulator.prefill_per_char": -1.0, "models[0].simulator.tool_arguments": "[]",
    "models[0].queue.ttft_p99": -1.0, "models[0].queue.window": 0.0,
    "models[0].queue.enter_after": 0, "models[0].queue.exit_after": 0,
    "models[0].queue.exit_ratio": 1.5, "models[0].queue.max_queued": 0,
    "models[0].queue.ttl": 0.0, "models[0].queue.min_concurrency": 0,
    "models[0].price_input": -1.0, "models[0].price_cached_input": 2e6,
    "models[0].price_output": -1.0, "models[0].price_request": -1.0,
    "models[0].queue.background_ttl": 0.0, "models[0].queue.batch_ttl": 0.0,
    "models[0].queue.preempt_after": -1.0, "models[0].queue.max_preemptions": 11,
    "tiers[0].name": Bad("t", {"tiers": [{}, {"name": "t"}]}, good="u"),
    "tiers[0].weight": 0.0,
    "tiers[0].tenants": Bad(["a"], {"tiers": [{}, {"name": "u", "tenants": ["a"]}]},
                            good=["b"]),
}

# Keys for which every value of the type is valid, and why.
ANY_VALUE: dict[str, str] = {
    "models[0].upstream_model": "any name the backend knows; empty is the model's name",
    "models[0].simulator.tool_call": "any tool name (a request that lists none gets text); "
                                     "empty is off",
}


KEYS = {key.name: key.type for key in schema.walk()}
LISTS = {"models": ModelConfig(name="m"), "tiers": TierConfig(name="t")}  # a first entry each


def _closed(tp: Any) -> bool:
    """Types whose every value is in range (a bool, one of some strings):
    their bad value is one of the wrong type, derived, not listed."""
    return tp is bool or typing.get_origin(tp) is typing.Literal


def _bad(key: str) -> Bad:
    tp = KEYS[key]
    if _closed(tp):
        return Bad("maybe" if tp is bool else "none of these")
    bad = BAD[key]
    return bad if isinstance(bad, Bad) else Bad(bad)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for name, value in extra.items():
        if name in LISTS and name in base:
            for mine, theirs in zip(base[name], value, strict=False):
                _merge(mine, theirs)
            base[name] += value[len(base[name]):]
        elif isinstance(value, dict) and isinstance(base.get(name), dict):
            _merge(base[name], value)
        else:
            base[name] = value
    return base


def _list(key: str) -> str | None:
    """The list of tables ``key`` is in (``models[0].name``: models), if any."""
    return next((name for name in LISTS if key.startswith(f"{name}[0].")), None)


def _raw(key: str, value: Any, context: dict[str, Any]) -> dict[str, Any]:
    """The overrides setting ``key`` to ``value`` beside ``context`` (and one
    model, and one tier for a tier's key)."""
    raw: dict[str, Any] = {"models": [{"name": "m"}]}
    table = _list(key)
    if table == "tiers":
        raw["tiers"] = [{"name": "t"}]
    at = raw[table][0] if table else raw
    *path, leaf = key.removeprefix(f"{table}[0].").split(".")
    for part in path:
        at = at.setdefault(part, {})
    at[leaf] = value
    return _merge(raw, json.loads(json.dumps(context)))


def _refusal(raw: dict[str, Any], env: dict[str, str]) -> str | None:
    """The message the config, then the first tier's preflight, refuses with."""
    try:
        config = tgconfig.load(None, env, raw)
        for tier in TIERS:
            preflight(config, tier, env)
    except ConfigError as exc:
        return str(exc)
    return None


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value)  # numbers, strings and flat lists read the same as TOML


def test_every_key_has_a_bad_value() -> None:
    """A new key fails here until its check exists (or every value is fine)."""
    open_keys = {key for key, tp in KEYS.items() if not _closed(tp)}
    assert sorted(open_keys - BAD.keys() - ANY_VALUE.keys()) == []
    assert sorted((BAD.keys() | ANY_VALUE.keys()) - open_keys) == []  # no stale entries
    assert not BAD.keys() & ANY_VALUE.keys()


@pytest.mark.parametrize("key", sorted(set(KEYS) - set(ANY_VALUE)))
def test_a_bad_value_is_refused_at_start_naming_the_key(key: str) -> None:
    bad = _bad(key)
    message = _refusal(_raw(key, bad.value, bad.context), {})
    assert message is not None, f"{key} = {bad.value!r} was accepted"
    assert "\n" not in message
    table = _list(key)
    assert key.removeprefix(f"{table}[0].") in message, message
    if table:
        assert f"{table}[" in message, message
    # A good value beside the same context is accepted: the value is what is refused.
    good = _default(key) if bad.good is None else bad.good
    assert _refusal(_raw(key, good, bad.context), {}) is None


@pytest.mark.parametrize("key", sorted(k for k in KEYS if not _list(k)))
def test_a_bad_value_in_the_environment_is_refused_naming_the_key(key: str) -> None:
    bad = _bad(key) if key not in ANY_VALUE else Bad(None)
    if key in ANY_VALUE or bad.context:
        pytest.skip("no bad value without other keys beside it")
    section, name = key.split(".")
    env = {f"TIDEGATE__{section.upper()}__{name.upper()}": _toml(bad.value)}
    message = _refusal({}, env)
    assert message is not None, f"{env} was accepted"
    assert "\n" not in message, message
    assert key in message, message


@pytest.mark.parametrize("key", sorted(KEYS))
def test_a_value_of_the_wrong_type_is_refused_naming_the_key(key: str) -> None:
    tp = KEYS[key]
    wrong: Any = {"a": 1} if tp is not str else 12
    message = _refusal(_raw(key, wrong, {}), {})
    assert message is not None, f"{key} = {wrong!r} was accepted"
    assert "\n" not in message, message
    assert message.startswith(f"{key}:"), message


def _default(key: str) -> Any:
    table = _list(key)
    at: Any = LISTS[table] if table else Config()
    for part in key.removeprefix(f"{table}[0].").split("."):
        at = getattr(at, part)
    if key == "models[0].max_streams":
        return 64  # set from the backend at construction; unset is not a TOML value
    return list(at) if isinstance(at, tuple) else at
