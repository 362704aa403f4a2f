"""Per-process telemetry around a tier's ``serve``: SDK setup, ``/metrics``,
and (dispatcher) the queue-depth poller.

The CLI runs every tier as ``run_service(instrumented(serve, tier), config)``,
so the tiers themselves only record. Where ``/metrics`` is:

* edge: its main HTTP port (``edge/app.py`` adds the route);
* dispatcher and worker: a small HTTP server on ``$TIDEGATE_METRICS_PORT``
  (bound to ``$TIDEGATE_METRICS_HOST``, default ``127.0.0.1``), when set.
  ``tidegate up`` gives each child its own port and prints them.

Queue depth is a fleet-wide value read from JetStream, so dispatchers export
it (each the same numbers; alert on ``max`` across them). The poller has its
own NATS connection, so it never queues behind the dispatch loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from tidegate.broker import broker
from tidegate.config import Config
from tidegate.run.runtime import Serve
from tidegate.telemetry import telemetry
from tidegate.telemetry.telemetry import Telemetry, TelemetrySettings

log = logging.getLogger("tidegate.telemetry")

METRICS_PORT_ENV = "TIDEGATE_METRICS_PORT"
METRICS_HOST_ENV = "TIDEGATE_METRICS_HOST"


def metrics_handler(tel: Telemetry) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def metrics(_request: web.Request) -> web.Response:
        # Collection runs the SDK's aggregation and the observable callbacks
        # (which only read in-memory state): microseconds to a few ms.
        body, content_type = tel.exposition()
        response = web.Response(body=body)
        response.headers["Content-Type"] = content_type
        return response

    return metrics


async def _alive(_request: web.Request) -> web.Response:
    """200 while the process's event loop runs: what a liveness probe needs."""
    return web.Response(text="ok\n")


async def start_metrics_server(tel: Telemetry, host: str, port: int) -> web.AppRunner:
    """``GET /metrics`` (and ``GET /healthz``, the liveness probe of tiers
    without an HTTP port of their own) on ``host:port``; the caller owns the runner."""
    app = web.Application()
    app.router.add_get("/metrics", metrics_handler(tel))
    app.router.add_get("/healthz", _alive)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    log.info("metrics on http://%s:%d/metrics", host, port)
    return runner


def metrics_address(env: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    env = os.environ if env is None else env
    raw = env.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{METRICS_PORT_ENV}: expected a port number, got {raw!r}") from None
    if not 0 < port <= 65535:
        raise ValueError(f"{METRICS_PORT_ENV}: must be 1..65535, got {port}")
    return env.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1", port


def instrumented(serve: Serve, tier: str) -> Serve:
    """``serve`` with this process's telemetry set up around it."""

    async def run(config: Config, stop: asyncio.Event) -> None:
        tel = telemetry.setup(TelemetrySettings.from_env(tier))
        try:
            async with contextlib.AsyncExitStack() as stack:
                address = metrics_address() if tier != "edge" else None
                if address is not None:
                    runner = await start_metrics_server(tel, *address)
                    stack.push_async_callback(runner.cleanup)
                async with asyncio.TaskGroup() as tg:
                    poller = (tg.create_task(_poll_queues(config, stop, tel))
                              if tier == "dispatcher" else None)
                    try:
                        await serve(config, stop)
                    finally:
                        if poller is not None:
                            poller.cancel()
        finally:
            # Blocks for at most the exporters' timeouts: queued spans of the
            # last requests are worth a moment at exit.
            await asyncio.to_thread(tel.shutdown)

    return run


async def _poll_queues(config: Config, stop: asyncio.Event, tel: Telemetry) -> None:
    """Never raises: a failure here must not take the dispatcher down with it."""
    try:
        await _poll_queues_until_stop(config, stop, tel)
    except Exception:
        log.exception("queue stats stopped; queue gauges are stale from now on")


async def _poll_queues_until_stop(config: Config, stop: asyncio.Event, tel: Telemetry) -> None:
    from tidegate.control import workers_registry
    from tidegate.control.queue_stats import QueueStats

    try:
        nc = await broker.connect(config.nats, "tidegate-dispatcher-stats", stop)
    except Exception as exc:  # stopped before NATS answered: nothing to report
        log.info("queue stats not started: %s", exc)
        return
    try:
        js = broker.jetstream(nc, config.nats)
        registry = None
        try:
            registry = await workers_registry.ensure_bucket(js, config)
        except Exception as exc:
            log.warning("worker registry unavailable, fleet gauges off: %s", exc)
        stats = QueueStats(js, config, registry)
        stats.register(tel.metrics)
        await stats.run(stop)
    finally:
        await broker.close(nc)
