"""Traces, metrics and log context through the real pipeline (processes).

* Traces: the children export over OTLP/HTTP to an in-process receiver
  (``bench.otlp_sink``); one request's spans from every tier share one
  trace id, parent links run edge -> (dispatcher ->) worker, the backend's
  HTTP request names the worker's span, and the GenAI attributes and events
  are there.
* Metrics: ``/metrics`` of the edge, the dispatcher and a worker, scraped and
  parsed after a run, has the expected series with plausible values.
* Queue depth: with no worker running, N queued requests show up as depth N
  on the dispatcher's ``/metrics``.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from bench.fake_backend import FakeBackend
from bench.otlp_sink import OtlpSink, ReceivedSpan, threaded_sink
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline, threaded_fake_backend

pytestmark = pytest.mark.pipeline

MODEL = "tidegate-sim"
FAKE = "fake-model"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"

T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 15.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def stream(pipeline: Pipeline, model: str, content: str,
           headers: dict[str, str] | None = None) -> tuple[str, str]:
    """A streaming chat request read to its end: (request id, body)."""
    req = urllib.request.Request(
        f"{pipeline.base_url}/chat/completions", method="POST",
        data=json.dumps({"model": model, "stream": True, "max_tokens": 12,
                         "messages": [{"role": "user", "content": content}]}).encode(),
        headers={"Authorization": f"Bearer {DEV_KEY}", "Content-Type": "application/json",
                 **(headers or {})})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return resp.headers["x-request-id"], resp.read().decode()


def stream_then_disconnect(pipeline: Pipeline, model: str, content: str) -> str:
    """Open a stream, read its first bytes, drop the connection: request id."""
    conn = http.client.HTTPConnection("127.0.0.1", pipeline.port, timeout=30)
    body = json.dumps({"model": model, "stream": True, "max_tokens": 400,
                       "messages": [{"role": "user", "content": content}]})
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"Authorization": f"Bearer {DEV_KEY}",
                          "Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    request_id = resp.headers["x-request-id"]
    assert resp.read1(64)
    if conn.sock is not None:
        conn.sock.close()
    conn.close()
    return request_id


def spans_of(sink: OtlpSink, request_id: str) -> dict[str, ReceivedSpan]:
    """The request's spans by service (its trace found through the edge span)."""
    spans = sink.snapshot()
    edge = [s for s in spans if s.service == "tidegate-edge"
            and s.attributes.get("tidegate.request.id") == request_id]
    if not edge:
        return {}
    trace = edge[0].trace_id
    return {s.service: s for s in spans if s.trace_id == trace}


# --------------------------------------------------------------------------
# Traces
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def sink() -> Iterator[OtlpSink]:
    with threaded_sink() as s:
        yield s


@pytest.fixture(scope="module")
def fake_backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=[FAKE], ttft=0.01, itl=0.005, tokens=12) as backend:
        yield backend


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
           module_redis_url: str, sink: OtlpSink,
           fake_backend: FakeBackend) -> Iterator[Pipeline]:
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": sink.url,
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach the sink quickly
        "OTEL_METRIC_EXPORT_INTERVAL": "500",
        "OTEL_TRACES_SAMPLER": "always_on",
    }
    models: list[dict[str, Any]] = [
        {"name": MODEL, "simulator": {"ttft": 0.01, "tokens_per_second": 400.0, "length": 32}},
        {"name": FAKE, "backend": "openai", "base_url": fake_backend.base_url},
    ]
    yield from running_pipeline(tmp_path_factory.mktemp("traced"), module_nats_url,
                                module_redis_url, env=env,
                                overrides={"models": models, "logging": {"json": True}})


def test_one_trace_spans_every_tier_and_reaches_the_backend(
        traced: Pipeline, sink: OtlpSink, fake_backend: FakeBackend) -> None:
    client_parent = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"
    request_id, body = stream(traced, FAKE, "trace me please",
                              headers={"traceparent": client_parent})
    assert body.endswith("data: [DONE]\n\n")
    spans = wait_for("edge and worker spans",
                     lambda: (lambda s: s if {"tidegate-edge", "tidegate-worker"} <= set(s)
                              else None)(spans_of(sink, request_id)))
    edge, worker = spans["tidegate-edge"], spans["tidegate-worker"]
    # The client's trace continues: one trace id from the client to the backend.
    assert edge.trace_id == worker.trace_id == CLIENT_TRACE
    assert edge.parent_span_id == CLIENT_PARENT
    assert edge.kind == 2  # SERVER
    assert worker.kind == 3  # CLIENT: the worker is the model server's GenAI client
    by_id = {s.span_id: s for s in spans.values()}
    chain, span = [], worker
    while span.parent_span_id in by_id:
        span = by_id[span.parent_span_id]
        chain.append(span.service)
    assert chain[-1] == "tidegate-edge", chain

    record = next(r for r in fake_backend.records if "trace me please" in
                  json.dumps(r.body.get("messages")))
    traceparent = {k.lower(): v for k, v in record.headers.items()}["traceparent"]
    assert traceparent.split("-")[1:3] == [worker.trace_id, worker.span_id]


def test_dispatcher_span_sits_between_edge_and_worker(traced: Pipeline,
                                                      sink: OtlpSink) -> None:
    request_id, _ = stream(traced, MODEL, "three tiers")
    spans = wait_for("all three tiers' spans",
                     lambda: (lambda s: s if len(s) >= 3 else None)(spans_of(sink, request_id)),
                     timeout=5.0)
    edge, dispatcher, worker = (spans["tidegate-edge"], spans["tidegate-dispatcher"],
                                spans["tidegate-worker"])
    assert dispatcher.parent_span_id == edge.span_id
    assert worker.parent_span_id == dispatcher.span_id


def test_genai_attributes_and_first_token_event(traced: Pipeline, sink: OtlpSink) -> None:
    request_id, _ = stream(traced, MODEL, "attributes")
    spans = wait_for("worker span",
                     lambda: (lambda s: s if "tidegate-worker" in s else None)(
                         spans_of(sink, request_id)))
    edge, worker = spans["tidegate-edge"], spans["tidegate-worker"]
    for span in (edge, worker):
        assert span.attributes["gen_ai.request.model"] == MODEL
        assert span.attributes["gen_ai.operation.name"] == "chat"
        assert span.attributes["gen_ai.request.max_tokens"] == 12
        assert span.attributes["tidegate.request.id"] == request_id
        assert span.name == f"chat {MODEL}"
    attrs = worker.attributes
    assert attrs["gen_ai.usage.input_tokens"] > 0
    assert attrs["gen_ai.usage.output_tokens"] == 12
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["tidegate.chunks"] >= 1
    assert attrs["tidegate.outcome"] == "done"
    assert worker.event_names() == ["gen_ai.first_token"]
    assert edge.attributes["http.response.status_code"] == 200
    # Spans carry no prompt text.
    assert not any(v == "attributes" for s in spans.values() for v in s.attributes.values())


def test_cancel_event_and_log_context(traced: Pipeline, sink: OtlpSink) -> None:
    request_id = stream_then_disconnect(traced, MODEL, "cancel me")
    spans = wait_for("cancelled worker span",
                     lambda: (lambda s: s if "tidegate-worker" in s else None)(
                         spans_of(sink, request_id)))
    worker, edge = spans["tidegate-worker"], spans["tidegate-edge"]
    assert ("tidegate.cancel", {"tidegate.cancel.cause": "client_disconnected"}) in worker.events
    assert "tidegate.cancel" in edge.event_names()
    assert worker.attributes["tidegate.outcome"] == "cancelled"

    # The worker's log line about the cancel carries the request's ids.
    def line() -> dict[str, Any] | None:
        for raw in (traced.workdir / "logs" / "worker0.log").read_text().splitlines():
            if raw.startswith("{") and request_id in raw and "cancelled" in raw:
                return dict(json.loads(raw))
        return None

    entry = wait_for("the worker's cancel log line", line)
    assert entry["request_id"] == entry["session"] == request_id
    assert entry["tenant"] == "default"
    assert entry["trace_id"] == worker.trace_id


def test_metrics_also_go_out_over_otlp(traced: Pipeline, sink: OtlpSink) -> None:
    stream(traced, MODEL, "otlp metrics")
    wait_for("OTLP metric exports with the GenAI histograms",
             lambda: "gen_ai.server.time_to_first_token" in sink.metric_names)


# --------------------------------------------------------------------------
# /metrics
# --------------------------------------------------------------------------


def samples(text: str) -> Parsed:
    out: Parsed = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


Parsed = dict[tuple[str, frozenset[tuple[str, str]]], float]


def maybe(parsed: Parsed, name: str, **labels: str) -> float | None:
    """The sum over series of ``name`` whose labels include ``labels``."""
    found = [v for (n, ls), v in parsed.items()
             if n == name and set(labels.items()) <= set(ls)
             and not any(k == "le" for k, _ in ls)]
    return sum(found) if found else None


def value(parsed: Parsed, name: str, **labels: str) -> float:
    found = maybe(parsed, name, **labels)
    if found is None:
        raise AssertionError(f"no series {name} with {labels}")
    return found


@pytest.fixture(scope="module")
def metered(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
            module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("metered"), module_nats_url,
                                module_redis_url, metrics=True,
                                overrides={"nats": {"subject_prefix": "tgm"}})


def test_metrics_after_a_run(metered: Pipeline) -> None:
    n = 5
    for i in range(n):
        stream(metered, MODEL, f"metrics {i}")
    stream_then_disconnect(metered, MODEL, "metrics cancel")
    m = MODEL

    def worker_settled() -> Parsed | None:
        parsed = samples(metered.scrape("worker0"))
        done = maybe(parsed, "tidegate_worker_jobs_total", gen_ai_request_model=m,
                     tidegate_outcome="done") or 0
        cancelled = maybe(parsed, "tidegate_worker_jobs_total", gen_ai_request_model=m,
                          tidegate_outcome="cancelled") or 0
        used = maybe(parsed, "tidegate_worker_slots", gen_ai_request_model=m,
                     tidegate_slot_state="used")
        return parsed if done >= n and cancelled >= 1 and used == 0 else None

    worker = wait_for("the worker's counters", worker_settled)
    ttft_count = value(worker, "gen_ai_server_time_to_first_token_seconds_count",
                       gen_ai_request_model=m)
    ttft_sum = value(worker, "gen_ai_server_time_to_first_token_seconds_sum",
                     gen_ai_request_model=m)
    assert ttft_count >= n + 1  # the warm-up request too
    assert 0 < ttft_sum / ttft_count < 2.0
    tpot_count = value(worker, "gen_ai_server_time_per_output_token_seconds_count",
                       gen_ai_request_model=m)
    tpot_sum = value(worker, "gen_ai_server_time_per_output_token_seconds_sum",
                     gen_ai_request_model=m)
    assert tpot_count >= n
    assert 0 < tpot_sum / tpot_count < 0.1  # 400 tokens/s sim
    duration = value(worker, "gen_ai_server_request_duration_seconds_count",
                     gen_ai_request_model=m)
    assert duration >= n + 1
    output_tokens = value(worker, "gen_ai_client_token_usage_sum", gen_ai_token_type="output")
    input_tokens = value(worker, "gen_ai_client_token_usage_sum", gen_ai_token_type="input")
    assert output_tokens >= n * 12
    assert input_tokens > 0
    assert value(worker, "tidegate_worker_slots", gen_ai_request_model=m,
                 tidegate_slot_state="free") == metered.config.models[0].max_streams
    assert value(worker, "tidegate_cancellations_total", tidegate_tier="worker",
                 tidegate_cancel_cause="client_disconnected") >= 1
    assert value(worker, "tidegate_queue_wait_seconds_count", gen_ai_request_model=m)

    edge = samples(metered.scrape("edge"))
    assert value(edge, "tidegate_edge_requests_total", tidegate_outcome="ok",
                 gen_ai_request_model=m) >= n
    assert value(edge, "tidegate_edge_requests_total", tidegate_outcome="cancelled") >= 1
    assert value(edge, "tidegate_cancellations_total", tidegate_tier="edge",
                 tidegate_cancel_cause="client_disconnected") >= 1
    assert value(edge, "tidegate_edge_streams_active") == 0
    # Open connections to the API port are counted: three idle sockets (the
    # scrape goes to the metrics port), and the count falls back once they close.
    idle = [socket.create_connection(("127.0.0.1", metered.port), timeout=5) for _ in range(3)]
    try:
        wait_for("3 idle connections counted", lambda: value(
            samples(metered.scrape("edge")), "tidegate_edge_connections_active") >= 3)
    finally:
        for sock in idle:
            sock.close()
    wait_for("closed connections uncounted", lambda: value(
        samples(metered.scrape("edge")), "tidegate_edge_connections_active") == 0)

    def dispatcher_sees_worker() -> Parsed | None:
        parsed = samples(metered.scrape("dispatcher"))
        return parsed if maybe(parsed, "tidegate_workers_live",
                               gen_ai_request_model=m) == 1 else None

    dispatcher = wait_for("the dispatcher to see the worker", dispatcher_sees_worker)
    assert value(dispatcher, "tidegate_queue_depth", gen_ai_request_model=m) == 0
    assert value(dispatcher, "tidegate_queue_oldest_age_seconds", gen_ai_request_model=m) == 0
    assert value(dispatcher, "tidegate_workers_slots", gen_ai_request_model=m,
                 tidegate_slot_state="free") == metered.config.models[0].max_streams


# --------------------------------------------------------------------------
# Queue depth
# --------------------------------------------------------------------------


def test_queue_depth_rises_with_no_worker(tmp_path: Path, module_nats_url: str,
                                          module_redis_url: str) -> None:
    n = 6
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, workers=0, metrics=True,
                        overrides={"nats": {"subject_prefix": "tgq"},
                                   "edge": {"queue_timeout": 30.0}})
    results: list[object] = []

    def client(i: int) -> None:
        try:
            results.append(pipeline.post("/v1/chat/completions", {
                "model": MODEL, "stream": True,
                "messages": [{"role": "user", "content": f"queued {i}"}]}, timeout=20))
        except Exception as exc:  # the pipeline stops under it
            results.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(n)]
    try:
        pipeline.start()
        started = time.monotonic()
        for t in threads:
            t.start()

        def depth_reported() -> Parsed | None:
            try:
                parsed = samples(pipeline.scrape("dispatcher"))
            except OSError:  # not listening yet: start() waited for the edge only
                return None
            depth = maybe(parsed, "tidegate_queue_depth", gen_ai_request_model=MODEL)
            return parsed if depth == n else None

        parsed = wait_for(f"queue depth {n}", depth_reported, timeout=20.0)
        assert value(parsed, "tidegate_queue_waiting", gen_ai_request_model=MODEL) == n
        age = value(parsed, "tidegate_queue_oldest_age_seconds", gen_ai_request_model=MODEL)
        assert 0 < age <= time.monotonic() - started + 1
        assert value(parsed, "tidegate_workers_live", gen_ai_request_model=MODEL) == 0
        edge = samples(pipeline.scrape("edge"))
        assert value(edge, "tidegate_edge_streams_active") == n
    finally:
        pipeline.stop()
        for t in threads:
            t.join(30)


def test_websocket_generation_has_its_own_span_marked_websocket(traced: Pipeline,
                                                                 sink: OtlpSink) -> None:
    from websockets.sync.client import connect as ws_connect

    with ws_connect(f"ws://127.0.0.1:{traced.port}/v1/ws",
                    additional_headers={"Authorization": f"Bearer {DEV_KEY}"}) as ws:
        ws.send(json.dumps({"type": "request", "id": "t", "path": "/v1/chat/completions",
                            "body": {"model": MODEL, "max_tokens": 5,
                                     "messages": [{"role": "user", "content": "ws trace"}]}}))
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(json.loads(ws.recv(timeout=20)))
    assert frames[0]["type"] == "accepted"
    assert frames[-1]["type"] == "done"
    request_id = frames[0]["request_id"]
    spans = wait_for("worker span", lambda: (lambda s: s if "tidegate-worker" in s else None)(
        spans_of(sink, request_id)))
    edge = spans["tidegate-edge"]
    assert edge.attributes["tidegate.transport"] == "websocket"
    assert edge.attributes["gen_ai.request.max_tokens"] == 5
    assert spans["tidegate-worker"].parent_span_id  # one trace, edge to worker
