"""Per-process telemetry around a tier's ``serve``: SDK setup, ``/metrics``
(``tidegate.telemetry.observability``), and (dispatcher) the queue-depth
poller. The CLI runs every tier as ``run_service(instrumented(serve, tier),
config)``, so the tiers themselves only record.

Queue depth is a fleet-wide value read from JetStream, so dispatchers export
it (each the same numbers; alert on ``max`` across them). The poller has its
own NATS connection, so it never queues behind the dispatch loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fleet.run.runtime import Serve
from tidegate.broker import broker
from tidegate.config import Config
from tidegate.control import workers_registry
from tidegate.control.queue_stats import QueueStats
from tidegate.errors import TidegateError
from tidegate.telemetry import telemetry
from tidegate.telemetry.observability import (
    METRICS_HOST_ENV,
    METRICS_PORT_ENV,
    metrics_address,
    start_metrics_server,
)
from tidegate.telemetry.telemetry import Telemetry, TelemetrySettings

log = logging.getLogger("tidegate.telemetry")


def _edge_address(config: Config, env_address: tuple[str, int] | None
                  ) -> tuple[str, int] | None:
    """The edge's metrics address: the environment's port (on the
    environment's host, else ``edge.metrics_host``), else the config's; a
    port of 0 either way is no metrics server."""
    edge = config.edge
    if env_address is not None:
        return os.environ.get(METRICS_HOST_ENV, "").strip() or edge.metrics_host, env_address[1]
    return (edge.metrics_host, edge.metrics_port) if edge.metrics_port else None


def instrumented(serve: Serve, tier: str) -> Serve:
    """``serve`` with this process's telemetry set up around it."""

    async def run(config: Config, stop: asyncio.Event) -> None:
        tel = telemetry.setup(TelemetrySettings.from_env(tier))
        try:
            async with contextlib.AsyncExitStack() as stack:
                address = metrics_address()
                if tier == "edge":
                    address = _edge_address(config, address)
                if address is not None and address[1]:  # port 0: no metrics server
                    try:
                        runner = await start_metrics_server(tel, *address)
                    except OSError as exc:  # one line, not a traceback: the fix is config
                        raise TidegateError(
                            f"cannot serve {tier} metrics on {address[0]}:{address[1]} "
                            f"({exc.strerror or exc}): give each process its own port "
                            f"({METRICS_PORT_ENV}"
                            + (", or edge.metrics_port; 0 = none)" if tier == "edge" else ")")
                        ) from None
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
