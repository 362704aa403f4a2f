"""Telemetry without servers: settings from the OTel environment, the no-op
default, the Prometheus exposition, trace-context helpers, the log context
filter, the edge's outcome classification and the registry's encoding."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from edge.instrument import RequestTelemetry
from tidegate import apis
from tidegate.config import LoggingConfig
from tidegate.control.queue_stats import _created_ms
from tidegate.control.workers_registry import SlotInfo, WorkerInfo
from tidegate.errors import ApiError, ConfigError
from tidegate.telemetry import logs, telemetry, tracing
from tidegate.telemetry import telemetry as tm
from tidegate.telemetry.observability import metrics_address
from tidegate.telemetry.telemetry import Telemetry, TelemetrySettings
from tidegate.wire.protocol import Api, Request

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(autouse=True)
def fresh_telemetry() -> Iterator[None]:
    telemetry.reset()
    yield
    telemetry.reset()


def request(**kw: object) -> Request:
    fields: dict[str, object] = dict(
        id="r1", reply="tg.out.e.r1", model="m", api=Api.CHAT, stream=True,
        body={"model": "m", "max_tokens": 5, "temperature": 0.5, "messages": []},
        created_ms=1, deadline_ms=2, window_bytes=1024, window_msgs=8, tenant="acme")
    fields.update(kw)
    return Request(**fields)  # type: ignore[arg-type]


# -- settings ------------------------------------------------------------------


def test_no_otel_variables_means_no_tracing() -> None:
    s = TelemetrySettings.from_env("edge", {})
    assert s == TelemetrySettings(service_name="tidegate-edge")
    tel = telemetry.setup(s)
    assert not tel.tracing
    assert tel.registry is not None  # /metrics still works


@pytest.mark.parametrize(("env", "traces", "metrics"), [
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True, False),
    ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://c:4318/v1/metrics"}, False, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"},
     False, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_METRICS_EXPORTER": "none"},
     True, False),
])
def test_exports_follow_the_standard_variables(env: dict[str, str], traces: bool,
                                               metrics: bool) -> None:
    s = TelemetrySettings.from_env("worker", env)
    assert (s.traces, s.otlp_metrics) == (traces, metrics)


def test_sdk_disabled_and_service_name() -> None:
    s = TelemetrySettings.from_env("edge", {"OTEL_SDK_DISABLED": "true",
                                            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"})
    assert s.disabled
    tel = telemetry.setup(s)
    assert tel.registry is None
    assert tel.exposition()[0] == b""
    assert TelemetrySettings.from_env("edge", {"OTEL_SERVICE_NAME": "gw"}).service_name == "gw"
    grpc = TelemetrySettings.from_env("edge", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                               "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})
    assert grpc.traces_protocol == grpc.metrics_protocol == "grpc"


def test_get_is_a_noop_until_setup() -> None:
    tel = telemetry.get()
    assert not tel.tracing
    tel.metrics.cancellations.add(1, {tm.CAUSE: "x"})  # nothing to record into, no error
    assert tel.exposition()[0] == b""


def test_metrics_address() -> None:
    assert metrics_address({}) is None
    assert metrics_address({"TIDEGATE_METRICS_PORT": "9464"}) == ("127.0.0.1", 9464)
    assert metrics_address({"TIDEGATE_METRICS_PORT": "9", "TIDEGATE_METRICS_HOST": "0.0.0.0"}) \
        == ("0.0.0.0", 9)
    assert metrics_address({"TIDEGATE_METRICS_PORT": "0"}) == ("127.0.0.1", 0)  # none
    with pytest.raises(ConfigError, match="TIDEGATE_METRICS_PORT"):
        metrics_address({"TIDEGATE_METRICS_PORT": "65536"})
    with pytest.raises(ConfigError, match="TIDEGATE_METRICS_PORT"):
        metrics_address({"TIDEGATE_METRICS_PORT": "http"})


# -- exposition ----------------------------------------------------------------


def parse(tel: Telemetry) -> dict[str, float]:
    body, content_type = tel.exposition()
    assert content_type.startswith("text/plain")
    return {f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(body.decode())
            for s in family.samples}


def test_exposition_names_units_and_observed_sources() -> None:
    tel = telemetry.setup(TelemetrySettings.from_env("worker", {}))
    m = tel.metrics
    m.time_to_first_token.record(0.05, {tm.MODEL: "m"})
    m.token_usage.record(12, {tm.MODEL: "m", tm.TOKEN_TYPE: "output"})
    m.cancellations.add(2, {tm.CAUSE: "client_disconnected", tm.TIER: "worker"})
    m.queue_mode.set(1, {tm.MODEL: "m"})
    m.observe_worker_slots(lambda: [(3.0, {tm.MODEL: "m", tm.SLOT_STATE: "used"})])
    m.observe_worker_slots(lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    parsed = parse(tel)
    assert parsed["gen_ai_server_time_to_first_token_seconds_count[('gen_ai_request_model', "
                  "'m')]"] == 1
    assert parsed["gen_ai_client_token_usage_sum[('gen_ai_request_model', 'm'), "
                  "('gen_ai_token_type', 'output')]"] == 12
    assert parsed["tidegate_cancellations_total[('tidegate_cancel_cause', "
                  "'client_disconnected'), ('tidegate_tier', 'worker')]"] == 2
    assert parsed["tidegate_queue_mode_active[('gen_ai_request_model', 'm')]"] == 1
    # A failing source costs its own series only.
    assert parsed["tidegate_worker_slots[('gen_ai_request_model', 'm'), "
                  "('tidegate_slot_state', 'used')]"] == 3


def test_ttft_buckets_are_the_semantic_conventions() -> None:
    tel = telemetry.setup(TelemetrySettings.from_env("worker", {}))
    tel.metrics.time_to_first_token.record(0.3, {tm.MODEL: "m"})
    les = [k for k in parse(tel) if k.startswith("gen_ai_server_time_to_first_token_seconds_"
                                                 "bucket")]
    assert any("'0.25'" in k for k in les)
    assert any("'10.0'" in k or "'10'" in k for k in les)


# -- trace context ------------------------------------------------------------------


def test_extract_and_inject_round_trip() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    assert tracing.extract(None) is None
    assert tracing.extract({"traceparent": "garbage"}) is None
    parent = tracing.extract({"traceparent": TRACEPARENT, "tracestate": "k=v"})
    assert parent is not None
    tracer = TracerProvider().get_tracer("t")
    span = tracer.start_span("s", context=parent)
    carrier = tracing.inject(span)
    assert carrier["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    assert carrier["traceparent"][36:52] != "00f067aa0ba902b7"  # the child's own id
    assert carrier["tracestate"] == "k=v"
    assert tracing.trace_id(carrier) == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert tracing.span_trace_id(span) == "4bf92f3577b34da6a3ce929d0e0e4736"


def test_parent_prefers_nats_headers_over_the_envelope() -> None:
    from opentelemetry.trace import get_current_span

    other = "00-11111111111111111111111111111111-2222222222222222-01"
    req = request(extra={"traceparent": TRACEPARENT})
    ctx = tracing.parent_of({"traceparent": other}, req)
    assert ctx is not None
    assert get_current_span(ctx).get_span_context().trace_id == 0x11111111111111111111111111111111
    ctx = tracing.parent_of(None, req)
    assert ctx is not None
    assert get_current_span(ctx).get_span_context().span_id == 0x00f067aa0ba902b7


def test_untraced_carrier_keeps_the_clients_or_makes_one() -> None:
    assert tracing.untraced_carrier({"traceparent": TRACEPARENT}) == {"traceparent": TRACEPARENT}
    made = tracing.untraced_carrier({})["traceparent"]
    version, trace, span, flags = made.split("-")
    assert (version, flags, len(trace), len(span)) == ("00", "00", 32, 16)
    assert made != tracing.untraced_carrier({})["traceparent"]


def test_genai_attributes() -> None:
    completion = request(api=Api.COMPLETIONS)
    attrs = tracing.request_attributes(completion, apis.of(completion.api).operation)
    assert attrs[tm.OPERATION] == "text_completion"
    assert attrs[tm.MODEL] == "m"
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.temperature"] == 0.5
    assert attrs["tidegate.tenant"] == "acme"
    assert attrs["tidegate.request.class"] == "interactive"
    batch = dataclasses.replace(completion, klass="batch")
    assert tracing.request_attributes(batch, "chat")["tidegate.request.class"] == "batch"
    assert "messages" not in json.dumps(attrs)
    usage = tracing.usage_attributes(3, 4, "stop", 2)
    assert usage == {"gen_ai.usage.input_tokens": 3, "gen_ai.usage.output_tokens": 4,
                     "tidegate.chunks": 2, "gen_ai.response.finish_reasons": ("stop",)}


# -- logs ------------------------------------------------------------------------------


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers = list(root.handlers)
    out = io.StringIO()
    logs.setup(LoggingConfig(json=True), stream=out)
    yield out
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)


def test_bound_request_context_is_on_every_line(log_stream: io.StringIO) -> None:
    log = logs.get("edge")
    log.info("before")
    token = logs.bind("req1", "acme", "4bf92f3577b34da6a3ce929d0e0e4736")
    try:
        log.info("during")
        log.info("explicit wins", extra={"tenant": "other"})
    finally:
        logs.unbind(token)
    log.info("after")
    before, during, explicit, after = (json.loads(line) for line in
                                       log_stream.getvalue().splitlines())
    assert "request_id" not in before
    assert "request_id" not in after
    assert during["request_id"] == during["session"] == "req1"
    assert during["tenant"] == "acme"
    assert during["trace_id"] == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert explicit["tenant"] == "other"


# -- edge outcome ----------------------------------------------------------------------


def edge_requests(tel: Telemetry) -> dict[str, float]:
    return {k: v for k, v in parse(tel).items() if k.startswith("tidegate_edge_requests_total")}


def _err(status: int, code: str) -> ApiError:
    return ApiError(status, "x", type="server_error", code=code)


@pytest.mark.parametrize(("steps", "status", "outcome", "code"), [
    ([], 200, "ok", None),
    ([("error", _err(502, "worker_lost"))], 200, "error", "worker_lost"),
    ([("error", _err(429, "rate_limit_tokens"))], 429, "client_error", "rate_limit_tokens"),
    ([("cancel", "client_disconnected")], 200, "cancelled", "client_disconnected"),
    ([("cancel", "edge:request_timeout"), ("error", _err(504, "request_timeout"))],
     504, "error", "request_timeout"),
    ([], 503, "error", "503"),
])
def test_edge_outcomes(steps: list[tuple[str, object]], status: int, outcome: str,
                       code: str | None) -> None:
    tel = telemetry.setup(TelemetrySettings.from_env("edge", {}))
    rt = RequestTelemetry(tel, {}, Api.CHAT)
    rt.started_request(request())
    for kind, arg in steps:
        if kind == "error":
            assert isinstance(arg, ApiError)
            rt.on_error(arg)
        else:
            rt.on_cancel(str(arg))
    rt.finish(status)
    (key,) = edge_requests(tel)
    assert f"('tidegate_outcome', '{outcome}')" in key
    assert (f"('error_type', '{code}')" in key) if code else "error_type" not in key


def test_edge_untraced_request_still_has_a_trace_id() -> None:
    tel = telemetry.setup(TelemetrySettings.from_env("edge", {}))
    rt = RequestTelemetry(tel, {"traceparent": TRACEPARENT}, Api.CHAT)
    assert rt.span is None
    assert rt.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    rt.on_first_byte()
    rt.on_first_byte()  # once only
    assert parse(tel)["tidegate_edge_time_to_first_byte_seconds_count[('gen_ai_request_model', "
                      "'')]"] == 1


# -- registry and queue stats encoding ------------------------------------------------------


def test_worker_info_round_trip() -> None:
    info = WorkerInfo("w1", "h", 42, 1.0, 2.0, {"m/x": SlotInfo(8, 3)}, draining=True)
    assert WorkerInfo.decode(info.encode()) == info
    assert info.models["m/x"].free == 5


def test_created_ms_of_an_envelope() -> None:
    assert _created_ms(request(created_ms=1234).encode()) == 1234
    assert _created_ms(b"\xc1") == 0
    assert _created_ms(None) == 0


# -- the dispatcher's helpers ------------------------------------------------------------


def test_dispatch_span_is_the_jobs_parent_and_passes_through_when_off() -> None:
    from opentelemetry.metrics import NoOpMeter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tel = Telemetry(provider.get_tracer("t"), NoOpMeter("t"), tracing=True)
    incoming = {"traceparent": TRACEPARENT, "Nats-Msg-Id": "r1"}
    with tracing.dispatch_span(tel, incoming, request(), "chat") as span:
        assert span is not None
        headers = tracing.job_headers(incoming)
    (finished,) = exporter.get_finished_spans()
    assert finished.name == "dispatch m"
    assert finished.parent is not None
    assert finished.parent.span_id == 0x00f067aa0ba902b7
    assert headers["traceparent"].split("-")[2] == f"{finished.context.span_id:016x}"
    assert finished.attributes is not None
    assert finished.attributes["gen_ai.request.model"] == "m"

    off = telemetry.noop()
    with tracing.dispatch_span(off, incoming, request(), "chat") as span:
        assert span is None
        assert tracing.job_headers(incoming) == {"traceparent": TRACEPARENT}
    assert tracing.job_headers(None) == {}
