"""Serving a process's ``/metrics``: the handler, a small metrics server and
where it listens. ``fleet.run.instrumented`` sets the SDK up around a
tier's ``serve`` and starts the server, so the tiers themselves only
record. Where ``/metrics`` is:

* every tier: a small HTTP server (``/metrics`` and ``/healthz``) on
  ``$TIDEGATE_METRICS_PORT``, bound to ``$TIDEGATE_METRICS_HOST`` (default
  ``127.0.0.1``), when set (0 = none). ``tidegate up`` gives each child its own port and
  prints them.
* edge, without the variable: ``edge.metrics_port`` on ``edge.metrics_host``
  (default 9464 on 127.0.0.1; 0 = none). Never the API port unless
  ``edge.metrics_public`` (``edge/app.py`` adds the route then): ``/metrics``
  takes no key, and tenant names, models and traffic are in it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping

from aiohttp import web

from tidegate.errors import ConfigError
from tidegate.telemetry.telemetry import Telemetry

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
    """``$TIDEGATE_METRICS_HOST``:``$TIDEGATE_METRICS_PORT``, or None when the
    port is unset; port 0 means no metrics server, as ``edge.metrics_port = 0``."""
    env = os.environ if env is None else env
    raw = env.get(METRICS_PORT_ENV, "").strip()
    if not raw:
        return None
    try:
        port = int(raw)
    except ValueError:
        raise ConfigError(f"{METRICS_PORT_ENV}: expected a port number (0 = no metrics "
                          f"server), got {raw!r}") from None
    if not 0 <= port <= 65535:
        raise ConfigError(f"{METRICS_PORT_ENV}: must be 0..65535 (0 = no metrics server), "
                          f"got {port}")
    return env.get(METRICS_HOST_ENV, "").strip() or "127.0.0.1", port
