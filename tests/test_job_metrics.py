"""What a finished job tells operators: its metrics and its span (workers.job.Job._observe).

An in-memory OpenTelemetry meter and span exporter stand in for the
exporters; the job runs on test_job_unit's fakes. Each figure is compared
with the usage record the same job published, so a metric recorded with the
wrong value, the wrong attributes, or not at all fails here (the mutants of
``Job._observe`` that only dashboards would have seen).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tests.test_job_unit import CONFIG, FakeBackend, FakeMsg, FakeNats, FakeStream, events
from tidegate.errors import BackendError
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire.protocol import Api, Request
from workers.job import Job
from workers.job_context import JobContext


class Observed:
    """A job run with telemetry kept in memory."""

    def __init__(self) -> None:
        self.reader = InMemoryMetricReader()
        self.spans = InMemorySpanExporter()
        tracer_provider = TracerProvider()
        tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.telemetry = Telemetry(tracer_provider.get_tracer("t"),
                                   MeterProvider(metric_readers=[self.reader]).get_meter("t"),
                                   tracing=True)

    async def run(self, backend: FakeBackend, queue_wait_ms: int = 250) -> FakeNats:
        now_ms = 1_000_000
        request = Request(id="r1", reply="_INBOX_edge.e1.r1", model="m", api=Api.CHAT,
                          stream=True, body={}, created_ms=now_ms,
                          deadline_ms=2**62, window_bytes=1 << 20, window_msgs=128,
                          tenant="t", user="u", key_id="k", klass="batch")
        nc = FakeNats()
        ctx = JobContext(config=CONFIG, nc=nc, control_subject="tg.ctl.w1",  # type: ignore[arg-type]
                         telemetry=self.telemetry)
        job = Job(FakeMsg(), request, backend, ctx)  # type: ignore[arg-type]
        job.queue_wait_ms = queue_wait_ms  # as the pool measured it at the pull
        await asyncio.wait_for(job.run(), 30)
        return nc

    def points(self, name: str) -> list[Any]:
        data = self.reader.get_metrics_data()
        assert data is not None
        return [point for rm in data.resource_metrics for sm in rm.scope_metrics
                for metric in sm.metrics if metric.name == name
                for point in metric.data.data_points]


@pytest.fixture
def observed() -> Observed:
    return Observed()


async def test_a_done_job_records_each_figure_of_its_usage(observed: Observed) -> None:
    nc = await observed.run(FakeBackend(FakeStream(events(3))))
    [record] = nc.usage()
    assert record.outcome == "done"
    [jobs] = observed.points("tidegate.worker.jobs")
    assert (jobs.value, jobs.attributes["tidegate.outcome"]) == (1, "done")
    tokens = {p.attributes["gen_ai.token.type"]: p for p in
              observed.points("gen_ai.client.token.usage")}
    assert (tokens["input"].sum, tokens["output"].sum) == (record.prompt_tokens,
                                                          record.completion_tokens)
    wait = record.queue_wait_ms / 1000
    [queued] = observed.points("tidegate.queue.wait")
    assert queued.sum == pytest.approx(wait)
    [ttft] = observed.points("gen_ai.server.time_to_first_token")
    assert ttft.count == 1
    assert ttft.sum == pytest.approx(wait + record.ttft_ms / 1000, abs=1e-3)
    [tpot] = observed.points("gen_ai.server.time_per_output_token")
    assert tpot.count == 1
    [duration] = observed.points("gen_ai.server.request.duration")
    assert duration.sum == pytest.approx(wait + record.duration_ms / 1000, abs=1e-3)
    assert "error.type" not in duration.attributes
    for point in (jobs, queued, ttft, tpot, duration, *tokens.values()):
        assert point.attributes["gen_ai.request.model"] == "m", point
    [span] = observed.spans.get_finished_spans()
    attrs = span.attributes or {}
    assert attrs["gen_ai.usage.input_tokens"] == record.prompt_tokens
    assert attrs["gen_ai.usage.output_tokens"] == record.completion_tokens
    assert attrs["tidegate.chunks"] == 3
    assert attrs["tidegate.outcome"] == "done"
    assert attrs["tidegate.queue.wait"] == pytest.approx(wait)
    assert attrs["tidegate.flow.stall_time"] == 0
    assert attrs["tidegate.request.class"] == "batch"
    assert span.status.status_code is not StatusCode.ERROR


async def test_a_failed_job_records_its_error_type_and_an_error_span(
        observed: Observed) -> None:
    refusal = BackendError(400, "no", type="invalid_request_error", code="bad")
    nc = await observed.run(FakeBackend(refuse=refusal), queue_wait_ms=0)
    [record] = nc.usage()
    [jobs] = observed.points("tidegate.worker.jobs")
    assert jobs.attributes["tidegate.outcome"] == record.outcome != "done"
    [duration] = observed.points("gen_ai.server.request.duration")
    assert duration.attributes["error.type"] == record.outcome
    # No output: no first token, no per-token time, no tokens counted.
    assert observed.points("gen_ai.server.time_to_first_token") == []
    assert observed.points("gen_ai.server.time_per_output_token") == []
    assert observed.points("gen_ai.client.token.usage") == []
    [span] = observed.spans.get_finished_spans()
    assert record.outcome == "error"
    assert (span.attributes or {})["tidegate.outcome"] == "error"
    assert span.status.status_code is StatusCode.ERROR
