"""Traces and metrics: the OpenTelemetry SDK, set up once per process from ``OTEL_*``.

With no variable set, metrics are served on ``/metrics`` and tracing is off (no
span objects, no export thread). ``OTEL_EXPORTER_OTLP_ENDPOINT`` exports spans
(and pushes metrics) over OTLP; ``OTEL_TRACES_EXPORTER=none`` /
``OTEL_METRICS_EXPORTER=none`` turn one export off; ``OTEL_SDK_DISABLED=true``
turns everything off. Every standard exporter variable works unchanged.

Invariant: nothing here runs per chunk; metrics are recorded once per request,
job, stall or cancel, and gauges are observed only at collection. Library code
gets the process's :class:`Telemetry` with :func:`get` (a no-op before
:func:`setup`); only a tier's entry point calls :func:`setup`.
Docs: docs/observability.md.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.trace import Tracer

log = logging.getLogger("tidegate.telemetry")

INSTRUMENTATION_SCOPE = "tidegate"

# -- attribute keys (GenAI semantic conventions where one exists) -------------
MODEL = "gen_ai.request.model"
OPERATION = "gen_ai.operation.name"
PROVIDER = "gen_ai.provider.name"
TOKEN_TYPE = "gen_ai.token.type"
ERROR_TYPE = "error.type"
CAUSE = "tidegate.cancel.cause"
TIER = "tidegate.tier"
OUTCOME = "tidegate.outcome"
LIMIT = "tidegate.quota.limit"
TENANT = "tidegate.tenant"
REQUEST_CLASS = "tidegate.request.class"  # interactive, background, batch (tidegate.wire.classes)
CURRENCY = "tidegate.currency"
BUDGET = "tidegate.budget"  # a budget's scope id (docs/spend.md)
THRESHOLD = "tidegate.budget.threshold"  # the fraction of a budget an alert is about
SLOT_STATE = "tidegate.slot.state"
REPLICA = "tidegate.replica"  # a backend replica of a model (docs/routing.md)
ROUTE_REASON = "tidegate.route.reason"  # why a job went where it went
REASON = "tidegate.reason"
SUBJECT_KIND = "tidegate.subject"
BATCH_STATUS = "tidegate.batch.status"
LINE_STATE = "tidegate.batch.line_state"
SLOT_MODE = "tidegate.slot.mode"  # "auto" (adaptive concurrency) | "fixed"

Attributes = Mapping[str, str | int | float | bool]
Observe = Callable[[], Iterable[tuple[float, Attributes]]]

# Bucket boundaries the GenAI semantic conventions recommend for each histogram.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0)
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48,
                     40.96, 81.92)
_TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304,
                  16777216, 67108864)
# Queue waits and stalls span milliseconds (a busy moment) to minutes (a
# saturated pool, a stuck client).
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                 120.0, 300.0)


class _Observed:
    """An observable instrument's callback that reads whatever sources the
    process registered (a tier registers its own: the edge its session table,
    a worker its slots). Sources are read only at collection time."""

    def __init__(self) -> None:
        self.sources: list[Observe] = []

    def __call__(self, _options: CallbackOptions) -> Iterable[Observation]:
        out: list[Observation] = []
        for source in self.sources:
            try:
                out.extend(Observation(value, dict(attrs)) for value, attrs in source())
            except Exception:  # a broken source must not break the whole scrape
                log.exception("metrics source failed")
        return out


class Metrics:
    """Every instrument tidegate records, created once per process.

    Names and units are the OTel ones; the Prometheus exposition turns dots
    into underscores and appends the unit and ``_total``
    (``gen_ai.server.time_to_first_token`` becomes
    ``gen_ai_server_time_to_first_token_seconds``). docs/observability.md
    lists every series with its labels.
    """

    def __init__(self, meter: Meter) -> None:
        # -- GenAI (workers, per finished job) ---------------------------------
        self.time_to_first_token = meter.create_histogram(
            "gen_ai.server.time_to_first_token", unit="s",
            description="From the edge accepting the request to the worker sending the first "
                        "output (queue wait included)",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS)
        self.time_per_output_token = meter.create_histogram(
            "gen_ai.server.time_per_output_token", unit="s",
            description="Per output token after the first, of successful responses",
            explicit_bucket_boundaries_advisory=_TPOT_BUCKETS)
        self.request_duration = meter.create_histogram(
            "gen_ai.server.request.duration", unit="s",
            description="From the edge accepting the request to the job's end "
                        "(error.type set when it did not complete)",
            explicit_bucket_boundaries_advisory=_DURATION_BUCKETS)
        self.token_usage = meter.create_histogram(
            "gen_ai.client.token.usage", unit="{token}",
            description="Tokens per request by gen_ai.token.type (input, output), as the "
                        "worker's backend reported them",
            explicit_bucket_boundaries_advisory=_TOKEN_BUCKETS)
        self.queue_wait = meter.create_histogram(
            "tidegate.queue.wait", unit="s",
            description="From the edge accepting the request to a worker picking up the job",
            explicit_bucket_boundaries_advisory=_WAIT_BUCKETS)
        self.jobs = meter.create_counter(
            "tidegate.worker.jobs", unit="{job}",
            description="Jobs a worker finished, by outcome (done, error, cancelled, "
                        "dropped, expired, handed_back)")
        self.stall_duration = meter.create_histogram(
            "tidegate.flow.stall.duration", unit="s",
            description="Time a job waited with its flow-control window full (one sample "
                        "per stall)",
            explicit_bucket_boundaries_advisory=_WAIT_BUCKETS)
        self.redeliveries = meter.create_counter(
            "tidegate.redeliveries", unit="{delivery}",
            description="Jobs or requests delivered more than once by JetStream")
        self.cancellations = meter.create_counter(
            "tidegate.cancellations", unit="{cancellation}",
            description="Cancelled requests by cause and by the tier that saw it")
        # -- routing across replicas (dispatcher; docs/routing.md) ---------------
        self.affinity_routes = meter.create_counter(
            "tidegate.affinity.routes", unit="{request}",
            description="Jobs of models with several replicas, by outcome (hit: sent to the "
                        "conversation's home; miss) and tidegate.route.reason")
        self.affinity_fallbacks = meter.create_counter(
            "tidegate.affinity.fallbacks", unit="{request}",
            description="Routed jobs also copied to the shared queue, by reason (wait: not "
                        "claimed within routing.max_affinity_wait)")
        self._replicas = _Observed()
        meter.create_observable_gauge(
            "tidegate.replica.in_flight", callbacks=[self._replicas], unit="{job}",
            description="Jobs running per backend replica as this dispatcher sees them "
                        "(the load spread across a model's replicas)")
        self._slots = _Observed()
        meter.create_observable_gauge(
            "tidegate.worker.slots", callbacks=[self._slots], unit="{slot}",
            description="This worker's job slots per model, by tidegate.slot.state "
                        "(used, free)")
        self._limit = _Observed()
        meter.create_observable_gauge(
            "tidegate.worker.concurrency_limit", callbacks=[self._limit], unit="{stream}",
            description="This worker's concurrent streams per model: the adaptive limit "
                        "(tidegate.slot.mode auto) or max_streams (fixed)")

        # -- edge ------------------------------------------------------------
        self.edge_requests = meter.create_counter(
            "tidegate.edge.requests", unit="{request}",
            description="Requests the edge finished, by outcome (ok, client_error, error, "
                        "cancelled) and error.type (the error code)")
        self.edge_time_to_first_byte = meter.create_histogram(
            "tidegate.edge.time_to_first_byte", unit="s",
            description="From the edge accepting the request to writing the first output "
                        "to the client",
            explicit_bucket_boundaries_advisory=_TTFT_BUCKETS)
        self._edge_streams = _Observed()
        meter.create_observable_gauge(
            "tidegate.edge.streams.active", callbacks=[self._edge_streams],
            unit="{stream}", description="Requests open on this edge")
        self._edge_connections = _Observed()
        meter.create_observable_gauge(
            "tidegate.edge.connections.active", callbacks=[self._edge_connections],
            unit="{connection}", description="Client HTTP connections open on this edge")
        self._ws_connections = _Observed()
        meter.create_observable_gauge(
            "tidegate.edge.ws.connections.active", callbacks=[self._ws_connections],
            unit="{connection}", description="WebSockets open on this edge (GET /v1/ws)")
        self._ws_generations = _Observed()
        meter.create_observable_gauge(
            "tidegate.edge.ws.generations.active", callbacks=[self._ws_generations],
            unit="{stream}", description="Generations running on this edge's WebSockets")

        self.edge_connections_refused = meter.create_counter(
            "tidegate.edge.connections.refused", unit="{connection}",
            description="Client connections the edge refused or cut, by tidegate.reason "
                        "(max_connections, max_per_ip, header_timeout, bad_http)")

        # -- untrusted broker input (every tier) -----------------------------------
        self.bad_messages = meter.create_counter(
            "tidegate.broker.bad_messages", unit="{message}",
            description="Broker messages a tier dropped as malformed or unexpected, by "
                        "tidegate.subject (which kind of subject) and tidegate.reason")

        # -- queues (dispatcher, fleet-wide values read from JetStream) -----------
        self._queue_depth = _Observed()
        meter.create_observable_gauge(
            "tidegate.queue.depth", callbacks=[self._queue_depth], unit="{job}",
            description="Jobs per model not yet finished: the worker consumer's "
                        "num_pending + num_ack_pending")
        self._queue_waiting = _Observed()
        meter.create_observable_gauge(
            "tidegate.queue.waiting", callbacks=[self._queue_waiting], unit="{job}",
            description="Jobs per model no worker has picked up (num_pending)")
        self._queue_oldest = _Observed()
        meter.create_observable_gauge(
            "tidegate.queue.oldest_age", callbacks=[self._queue_oldest], unit="s",
            description="Age of the oldest job per model no worker has picked up, from the "
                        "edge accepting its request (0 when none waits)")
        self._requests_backlog = _Observed()
        meter.create_observable_gauge(
            "tidegate.dispatch.backlog", callbacks=[self._requests_backlog], unit="{request}",
            description="Requests waiting for a dispatcher (requests consumer num_pending + "
                        "num_ack_pending)")
        self._workers_live = _Observed()
        meter.create_observable_gauge(
            "tidegate.workers.live", callbacks=[self._workers_live], unit="{worker}",
            description="Workers per model with a fresh heartbeat in the TG_WORKERS registry")
        self._fleet_slots = _Observed()
        meter.create_observable_gauge(
            "tidegate.workers.slots", callbacks=[self._fleet_slots], unit="{slot}",
            description="Job slots per model across live workers, by tidegate.slot.state")

        # -- admission (dispatcher) --------------------------------------------
        self.queue_mode = meter.create_gauge(
            "tidegate.queue_mode.active", unit="1",
            description="1 while the model is in queue mode, else 0")
        self.queue_mode_limit = meter.create_gauge(
            "tidegate.queue_mode.limit", unit="{request}",
            description="The admission limit queue mode currently applies to the model")
        self.queue_mode_queued = meter.create_gauge(
            "tidegate.queue_mode.queued", unit="{request}",
            description="Requests held in the model's queue-mode fair queue")
        self.slots_spare = meter.create_gauge(
            "tidegate.slots.spare", unit="{slot}",
            description="The model's slots on live workers less its jobs in flight, as "
                        "the dispatcher's gate sees them (0: lower classes wait)")
        self.spend = meter.create_counter(
            "tidegate.spend", unit="{currency}",
            description="Money spent, in spend.currency, by tenant and model (the cost "
                        "of every finished job at its model's price)")
        self.operator_tokens = meter.create_counter(
            "tidegate.operator.prompt_tokens", unit="{token}",
            description="Prompt tokens continuations cost beyond their requests' own "
                        "(delivered text read again): the operator's, billed to no tenant")
        self.budget_alerts = meter.create_counter(
            "tidegate.budget.alerts", unit="{alert}",
            description="A budget's spend crossed an alert threshold (spend.alert_at), by "
                        "budget and threshold")
        self.quota_rejections = meter.create_counter(
            "tidegate.quota.rejections", unit="{request}",
            description="Requests rejected by a quota, by tidegate.quota.limit (requests, "
                        "tokens, concurrency, store_unavailable)")
        self.dispatch_decisions = meter.create_counter(
            "tidegate.dispatch.decisions", unit="{request}",
            description="Admission decisions by tidegate.outcome (admitted, queued, rejected)")

        # -- batches (the dispatcher leading the batch runner, docs/batch.md) ---
        self.batches = meter.create_gauge(
            "tidegate.batch.batches", unit="{batch}",
            description="Batches by tidegate.batch.status")
        self.batch_lines = meter.create_gauge(
            "tidegate.batch.lines", unit="{request}",
            description="Lines of active batches per model, by tidegate.batch.line_state "
                        "(pending, running, done)")
        self.batch_slot_share = meter.create_gauge(
            "tidegate.batch.slot_share", unit="1",
            description="Share of the model's live worker slots held by batch lines")
        self.batch_at_risk = meter.create_gauge(
            "tidegate.batch.at_risk", unit="{batch}",
            description="Active batches that will miss their completion window at their "
                        "current rate")

    # -- registering observed sources ------------------------------------------

    def observe_replicas(self, source: Observe) -> None:
        """``source`` yields ``(in_flight, {MODEL: m, REPLICA: r})``."""
        self._replicas.sources.append(source)

    def observe_worker_slots(self, source: Observe) -> None:
        """``source`` yields ``(count, {MODEL: m, SLOT_STATE: "used"|"free"})``."""
        self._slots.sources.append(source)

    def observe_worker_limit(self, source: Observe) -> None:
        """``source`` yields ``(limit, {MODEL: m, SLOT_MODE: "auto"|"fixed"})``."""
        self._limit.sources.append(source)

    def observe_edge(self, streams: Callable[[], int], connections: Callable[[], int]) -> None:
        self._edge_streams.sources.append(lambda: ((float(streams()), {}),))
        self._edge_connections.sources.append(lambda: ((float(connections()), {}),))

    def observe_ws(self, connections: Callable[[], int], generations: Callable[[], int]) -> None:
        self._ws_connections.sources.append(lambda: ((float(connections()), {}),))
        self._ws_generations.sources.append(lambda: ((float(generations()), {}),))

    def observe_queues(self, depth: Observe, waiting: Observe, oldest_age: Observe,
                       backlog: Observe, workers: Observe, fleet_slots: Observe) -> None:
        """The fleet view a :class:`~tidegate.control.queue_stats.QueueStats` keeps."""
        self._queue_depth.sources.append(depth)
        self._queue_waiting.sources.append(waiting)
        self._queue_oldest.sources.append(oldest_age)
        self._requests_backlog.sources.append(backlog)
        self._workers_live.sources.append(workers)
        self._fleet_slots.sources.append(fleet_slots)


# --------------------------------------------------------------------------
# Settings and setup
# --------------------------------------------------------------------------


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _exporters(value: str | None) -> set[str]:
    return {v.strip().lower() for v in (value or "otlp").split(",") if v.strip()}


@dataclass(frozen=True, slots=True)
class TelemetrySettings:
    """What :func:`setup` turns on, decided from the environment alone."""

    service_name: str
    disabled: bool = False  # OTEL_SDK_DISABLED
    traces: bool = False  # OTLP span export
    otlp_metrics: bool = False
    traces_protocol: str = "http/protobuf"
    metrics_protocol: str = "http/protobuf"

    @classmethod
    def from_env(cls, tier: str, env: Mapping[str, str] | None = None) -> TelemetrySettings:
        env = os.environ if env is None else env
        name = env.get("OTEL_SERVICE_NAME") or f"tidegate-{tier}"
        if _truthy(env.get("OTEL_SDK_DISABLED")):
            return cls(service_name=name, disabled=True)
        base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        protocol = env.get("OTEL_EXPORTER_OTLP_PROTOCOL", "").strip() or "http/protobuf"
        traces = bool(base or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()) and \
            "otlp" in _exporters(env.get("OTEL_TRACES_EXPORTER"))
        otlp_metrics = bool(base or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip()) \
            and "otlp" in _exporters(env.get("OTEL_METRICS_EXPORTER"))
        return cls(
            service_name=name, traces=traces, otlp_metrics=otlp_metrics,
            traces_protocol=env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip() or protocol,
            metrics_protocol=(env.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", "").strip()
                              or protocol))


class Telemetry:
    """One process's tracer, metrics and ``/metrics`` exposition.

    ``tracing`` is False whenever spans are not exported: then ``tracer`` is
    the API's no-op tracer, and instrumented code skips building span
    attributes altogether (``if telemetry.tracing: ...``).
    """

    def __init__(self, tracer: Tracer, meter: Meter, *, tracing: bool,
                 registry: Any = None, shutdown: Sequence[Callable[[], object]] = ()) -> None:
        self.tracer = tracer
        self.tracing = tracing
        self.metrics = Metrics(meter)
        self.registry = registry  # prometheus_client CollectorRegistry, or None
        self._shutdown = list(shutdown)

    def exposition(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every instrument: body, content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if self.registry is None:
            return b"", CONTENT_TYPE_LATEST
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def shutdown(self) -> None:
        """Flush spans and metrics still queued; idempotent."""
        hooks, self._shutdown = self._shutdown, []
        for hook in hooks:
            try:
                hook()
            except Exception as exc:
                log.warning("telemetry shutdown: %s", exc)


def noop() -> Telemetry:
    return Telemetry(trace.NoOpTracer(), otel_metrics.NoOpMeter(INSTRUMENTATION_SCOPE),
                     tracing=False)


_current: Telemetry | None = None


def get() -> Telemetry:
    """The process's telemetry (a no-op one until :func:`setup` ran)."""
    global _current
    if _current is None:
        _current = noop()
    return _current


def setup(settings: TelemetrySettings, instance_id: str = "") -> Telemetry:
    """Build the SDK pipeline ``settings`` asks for and make it :func:`get`'s.

    Providers are kept on the returned object, not installed as the OTel
    globals, so a test can build several in one process. Call
    :meth:`Telemetry.shutdown` before exiting so queued spans are sent.
    """
    global _current
    if settings.disabled:
        _current = noop()
        return _current

    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.sdk.metrics import AlwaysOffExemplarFilter, MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
    from prometheus_client import CollectorRegistry

    import tidegate

    attributes: dict[str, str] = {"service.name": settings.service_name,
                                  "service.version": tidegate.__version__}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; OTEL_SERVICE_NAME is
    # already in settings.service_name.
    resource = Resource.create(attributes)

    registry = CollectorRegistry(auto_describe=True)
    readers: list[MetricReader] = [PrometheusMetricReader(registry=registry,
                                                          scope_info_enabled=False)]
    if settings.otlp_metrics:
        readers.append(PeriodicExportingMetricReader(_metric_exporter(settings.metrics_protocol)))
    # Exemplars link a sample to the trace current when it was recorded; with
    # no tracing there is none, and the filter would only cost time per call.
    meter_provider = MeterProvider(
        metric_readers=readers, resource=resource,
        exemplar_filter=None if settings.traces else AlwaysOffExemplarFilter())
    shutdown: list[Callable[[], object]] = [meter_provider.shutdown]

    tracer: Tracer = trace.NoOpTracer()
    if settings.traces:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # TracerProvider reads OTEL_TRACES_SAMPLER / _ARG itself.
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(
            BatchSpanProcessor(_span_exporter(settings.traces_protocol)))
        tracer = tracer_provider.get_tracer(INSTRUMENTATION_SCOPE, tidegate.__version__)
        shutdown.insert(0, tracer_provider.shutdown)

    _current = Telemetry(tracer, meter_provider.get_meter(INSTRUMENTATION_SCOPE),
                         tracing=settings.traces, registry=registry, shutdown=shutdown)
    log.info("telemetry: traces %s, metrics on /metrics%s",
             f"over OTLP ({settings.traces_protocol})" if settings.traces else "off",
             f" and over OTLP ({settings.metrics_protocol})" if settings.otlp_metrics else "")
    return _current


def reset() -> None:
    """Back to the no-op telemetry (tests)."""
    global _current
    if _current is not None:
        _current.shutdown()
    _current = None


def _span_exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        return GrpcSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def _metric_exporter(protocol: str) -> Any:
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )

        return GrpcMetricExporter()
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter()
