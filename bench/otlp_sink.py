"""A minimal in-process OTLP/HTTP receiver: collects spans, counts metrics.

For tests (one trace across the tiers) and the benchmark (tracing on, with an
exporter that really sends). It accepts ``POST /v1/traces`` and
``POST /v1/metrics`` with protobuf bodies (gzip or not), decodes spans into
:class:`ReceivedSpan` and answers 200 with an empty export response, as a
collector would. ``GET /stats`` answers what it received so far as JSON
(spans by service, distinct traces, metric exports). Not a collector: no
retries, no persistence, no auth.

``python -m bench.otlp_sink --port N`` runs one as its own process (the
benchmark's traced run does, so the receiver's CPU is not counted as the
gateway's); there it only counts spans, it does not keep them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from fleet.run.servers import free_port


@dataclass(frozen=True, slots=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int  # OTLP SpanKind: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[tuple[str, dict[str, Any]], ...] = ()
    status_code: int = 0  # 0 unset, 1 ok, 2 error
    # Wall clock, ns since the epoch: one machine's processes share the clock
    # (bench.hops lays a request's waits along its spans with them).
    start_ns: int = 0
    end_ns: int = 0
    event_ns: tuple[int, ...] = ()  # each event's time, in the order of events

    def event_names(self) -> list[str]:
        return [name for name, _ in self.events]


def _value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attributes(kvs: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in kvs}


class OtlpSink:
    def __init__(self, *, keep_spans: bool = True) -> None:
        self.keep_spans = keep_spans  # False: count spans, do not keep them
        self.spans: list[ReceivedSpan] = []
        self.span_counts: Counter[str] = Counter()  # by service.name
        self.trace_ids: set[str] = set()
        self.trace_exports = 0
        self.metric_exports = 0
        self.metric_names: set[str] = set()
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._lock = threading.Lock()  # tests read from another thread

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        port = port or free_port(host)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", self._metrics)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/spans", self._spans)
        app.router.add_post("/reset", self._reset)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self.url = f"http://{host}:{port}"
        self._runner = runner

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        data = await request.read()
        if request.headers.get("Content-Encoding", "").lower() == "gzip":
            data = gzip.decompress(data)
        return data

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await self._body(request))
        spans: list[ReceivedSpan] = []
        for rs in export.resource_spans:
            resource = _attributes(rs.resource.attributes)
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        kind=int(s.kind), attributes=_attributes(s.attributes),
                        events=tuple((e.name, _attributes(e.attributes)) for e in s.events),
                        status_code=int(s.status.code), start_ns=int(s.start_time_unix_nano),
                        end_ns=int(s.end_time_unix_nano),
                        event_ns=tuple(int(e.time_unix_nano) for e in s.events)))
        with self._lock:
            self.trace_exports += 1
            self.span_counts.update(s.service for s in spans)
            self.trace_ids.update(s.trace_id for s in spans)
            if self.keep_spans:
                self.spans.extend(spans)
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def _metrics(self, request: web.Request) -> web.Response:
        export = ExportMetricsServiceRequest()
        export.ParseFromString(await self._body(request))
        names = {m.name for rm in export.resource_metrics for sm in rm.scope_metrics
                 for m in sm.metrics}
        with self._lock:
            self.metric_exports += 1
            self.metric_names |= names
        return web.Response(body=ExportMetricsServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def stats(self) -> dict[str, Any]:
        """What arrived so far: spans by service, distinct traces, exports."""
        with self._lock:
            return {"spans": sum(self.span_counts.values()),
                    "spans_by_service": dict(self.span_counts),
                    "traces": len(self.trace_ids), "trace_exports": self.trace_exports,
                    "metric_exports": self.metric_exports,
                    "metric_names": sorted(self.metric_names)}

    async def _stats(self, _request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _spans(self, _request: web.Request) -> web.Response:
        """The kept spans (``--keep``), as JSON objects of ReceivedSpan's fields."""
        return web.json_response([dataclasses.asdict(s) for s in self.snapshot()])

    async def _reset(self, _request: web.Request) -> web.Response:
        with self._lock:
            self.spans.clear()
        return web.json_response({})


@contextmanager
def threaded_sink() -> Iterator[OtlpSink]:
    """An :class:`OtlpSink` on its own event loop thread (sync callers, and
    child processes exporting to it)."""
    loop = asyncio.new_event_loop()
    sink = OtlpSink()
    ready = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(sink.start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, name="otlp-sink", daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("OTLP sink did not start")
    try:
        yield sink
    finally:
        asyncio.run_coroutine_threadsafe(sink.stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


async def _serve(host: str, port: int, keep: bool = False) -> None:
    sink = OtlpSink(keep_spans=keep)
    await sink.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"OTLP sink on {sink.url}", flush=True)
    try:
        await stop.wait()
    finally:
        await sink.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.otlp_sink",
                                     description="Receive OTLP/HTTP spans and metrics and "
                                                 "count them (GET /stats).")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--keep", action="store_true",
                        help="keep the spans (GET /spans lists them, POST /reset drops them)")
    args = parser.parse_args(argv)
    asyncio.run(_serve(args.host, args.port, args.keep))


if __name__ == "__main__":
    main()
