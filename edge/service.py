"""Edge process: connect, provision, serve HTTP, drain on stop.

Shutdown order (STYLE 8): mark draining (``/readyz`` turns 503 and requests on
kept-alive connections get a retryable 503; gRPC health turns NOT_SERVING and
its connections get GOAWAY), stop listening, let open streams finish within
``edge.shutdown_timeout``, end the rest with a retryable SSE error event (and
cancel their work upstream), then close NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator

from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from edge import resume
from edge.app import build_app
from edge.auth import KeyTable
from edge.endings import Reconnect
from edge.grpc_server import GrpcIngress
from edge.guard import GuardedSite
from edge.listen import cannot_listen, ensure_free
from edge.session import SessionTable
from edge.state import EdgeState
from edge.tls import server_tls_context, warn_if_public_plaintext
from tidegate.broker import bodies, broker
from tidegate.broker.kvwatch import wait_synced
from tidegate.config import Config
from tidegate.control import edges_registry
from tidegate.control.keys import (
    ensure_keys_bucket,
    ensure_last_used_bucket,
    record_last_used,
    watch_keys,
)
from tidegate.control.tenants import TenantTable, ensure_tenants_bucket, watch_tenants
from tidegate.errors import ApiError
from tidegate.wire import streamlog

log = logging.getLogger("tidegate.edge")
LAST_USED_INTERVAL = 5.0  # seconds between an edge's writes of keys' last use


async def _drain(sessions: SessionTable, grace: float) -> None:
    """Let open requests finish within ``grace``; then end the rest."""
    log.info("draining %d open requests, up to %.0fs", len(sessions), grace)
    # Resumable streams need not finish here: their clients resume on another
    # edge from the log (the reconnect event says where), so they go at once.
    # A session already aborted (a WebSocket generation its socket told to
    # reconnect, in its own frames) keeps that ending.
    for session in sessions.open_sessions():
        if session.resumable and session.aborted is None:
            session.abort(Reconnect())
    if await sessions.wait_empty(grace):
        return
    log.warning("ending %d requests still open after %.0fs", len(sessions), grace)
    for session in sessions.open_sessions():
        session.abort(ApiError(503, "This gateway node is shutting down; retry the request.",
                               type="server_error", code="edge_shutting_down", retryable=True,
                               retry_after=1))
    await sessions.wait_empty(2.0)  # time for the error events to be written


@contextlib.asynccontextmanager
async def _keys_watch(js: JetStreamContext, config: Config,
                      keys: KeyTable) -> AsyncIterator[None]:
    """Keep ``keys`` in step with the ``<P>_KEYS`` bucket while the edge runs.

    Waits (up to nats.request_timeout) for the existing keys before returning,
    so the edge does not start listening and turn away valid keys with 401.
    """
    kv = await ensure_keys_bucket(js, config)
    synced = asyncio.Event()
    task = asyncio.create_task(watch_keys(kv, keys.apply, keys.remove, on_synced=synced.set),
                               name="tidegate-edge-keys-watch")
    task.add_done_callback(_report_watch_exit)
    usage = asyncio.create_task(_flush_last_used(js, config, keys),
                                name="tidegate-edge-keys-last-used")
    try:
        await wait_synced(synced, config.nats.request_timeout,
                          f"API keys from {config.nats.subjects.keys_bucket}")
        yield
    finally:
        task.cancel()
        usage.cancel()
        await asyncio.gather(task, usage, return_exceptions=True)


async def _flush_last_used(js: JetStreamContext, config: Config, keys: KeyTable) -> None:
    """Every few seconds, tell ``<P>_KEYUSE`` which keys this edge accepted
    (`tidegate keys list` shows it). Best effort: a failed flush is retried
    with the next interval's uses; it never touches the request path."""
    kv = None
    while True:
        await asyncio.sleep(LAST_USED_INTERVAL)
        if not keys.last_used:
            continue
        try:
            if kv is None:
                kv = await ensure_last_used_bucket(js, config)
            await record_last_used(kv, keys.last_used)
        except Exception as exc:
            log.debug("recording keys' last use failed: %s", exc)


def _report_watch_exit(task: asyncio.Task[None]) -> None:
    # The watch rides out NATS outages itself; ending any other way is a bug,
    # and revoked keys would keep working, so say so at once.
    if not task.cancelled() and task.exception() is not None:
        log.error("API key watch stopped: key changes no longer apply on this edge",
                  exc_info=task.exception())


async def serve(config: Config, stop: asyncio.Event) -> None:
    edge_id = config.edge.edge_id or secrets.token_hex(6)
    nc = await broker.connect(config.nats, f"tidegate-edge-{edge_id}", stop)
    try:
        js = broker.jetstream(nc, config.nats)
        await broker.ensure_streams(js, config)
        await bodies.ensure(js, config)  # where bodies too large for a message go
        keys = KeyTable(config.api_keys())
        tenants = TenantTable()
        async with _keys_watch(js, config, keys), _tenants_watch(js, config, tenants):
            await _serve_http(config, stop, edge_id, nc, js, keys, tenants)
    finally:
        # After the keys watch has stopped: it must not see NATS close under it.
        await broker.close(nc)
        log.info("edge %s stopped", edge_id)


@contextlib.asynccontextmanager
async def _tenants_watch(js: JetStreamContext, config: Config,
                         tenants: TenantTable) -> AsyncIterator[None]:
    """Keep ``tenants`` (per-tenant settings: resumable) in step with ``<P>_TENANTS``."""
    kv = await ensure_tenants_bucket(js, config)
    synced = asyncio.Event()
    task = asyncio.create_task(watch_tenants(kv, tenants, on_synced=synced.set),
                               name="tidegate-edge-tenants-watch")
    task.add_done_callback(_report_watch_exit)
    try:
        await wait_synced(synced, config.nats.request_timeout, "tenant settings")
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _serve_http(config: Config, stop: asyncio.Event, edge_id: str, nc: NATS,
                      js: JetStreamContext, keys: KeyTable, tenants: TenantTable) -> None:
    subjects = config.nats.subjects
    if not len(keys):
        log.warning("no API keys configured: every request will get 401 "
                    "(create one with `tidegate keys create`, or set TIDEGATE_DEV_KEY "
                    "or auth.keys)")
    inbox = subjects.edge_inbox(edge_id)
    sessions = SessionTable(inbox[:-1])  # strip the "*": "<p>.out.<edge>."
    # Tombstones are published straight to the bucket's subject (see
    # NatsPublisher.tombstone): the bucket must exist for them to be stored.
    await broker.ensure_cancels_bucket(js, config)
    state = EdgeState(config=config, edge_id=edge_id, nc=nc, js=js, keys=keys,
                      sessions=sessions, tenants=tenants)

    async def on_out(msg: Msg) -> None:
        sessions.dispatch(msg.subject, msg.data)

    # POST /v1/streams/{id}/cancel made on another edge (edge.resume).
    await nc.subscribe(streamlog.edge_cancel_subject(subjects),
                       cb=resume.remote_cancel_handler(sessions))

    # Flow control bounds what each session has in flight, so these limits are
    # a backstop against a misbehaving worker, not the normal bound.
    await nc.subscribe(inbox, cb=on_out, pending_msgs_limit=1_000_000,
                       pending_bytes_limit=1 << 30)

    app = build_app(state)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=config.edge.shutdown_timeout)
    await runner.setup()
    server = runner.server
    state.telemetry.metrics.observe_edge(
        streams=lambda: len(sessions),
        connections=lambda: len(server.connections) if server is not None else 0)
    state.telemetry.metrics.observe_ws(connections=lambda: len(state.sockets),
                                       generations=lambda: state.sockets.generations)
    tls = server_tls_context(config.edge)
    # reuse_port: N edges of one host on one port (tidegate up --edges N).
    site = GuardedSite(runner, config.edge, backlog=4096, ssl_context=tls,
                       reuse_port=config.edge.reuse_port or None)
    if config.edge.grpc_port:  # refused before the edge says it listens on either port
        ensure_free("edge.grpc_port", config.edge.host, config.edge.grpc_port,
                    reuse_port=config.edge.reuse_port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise cannot_listen("edge.port", config.edge.host, config.edge.port, exc) from None
    log.info("edge %s listening on %s://%s:%d (nats %s)", edge_id,
             "https" if tls else "http", config.edge.host, config.edge.port, config.nats.url)
    warn_if_public_plaintext(config.edge)
    grpc_ingress: GrpcIngress | None = None
    if config.edge.grpc_port:
        grpc_ingress = GrpcIngress(state)
        await grpc_ingress.start()
    registry = await edges_registry.ensure_bucket(js, config)
    started = time.time()
    # The edge's entry in <P>_EDGES (tidegate status): open requests and sockets.
    beat = asyncio.create_task(edges_registry.heartbeat(
        registry, lambda: edges_registry.local_info(
            edge_id, started, streams=len(sessions), ws_connections=len(state.sockets),
            ws_generations=state.sockets.generations, draining=state.draining),
        interval=min(edges_registry.HEARTBEAT, config.session.heartbeat_interval)),
        name="tidegate-edge-registry")
    try:
        await stop.wait()
    finally:
        state.draining = True
        await site.stop()
        # WebSockets: no new generations; idle sockets close (1012) at once, the
        # others when their last generation has ended or been ended by _drain.
        state.sockets.drain()
        state.streamlog.drain()  # resumed readers: told to reconnect too
        # WebSocket resume generations end by themselves once their reader
        # sees the drain; they get that moment before close_all (together
        # with the requests' drain, so neither waits for the other).
        # gRPC: NOT_SERVING and GOAWAY; its calls end with the sessions'
        # drain (resumable ones told to reconnect) or at shutdown_timeout.
        await asyncio.gather(state.sockets.wait_resumed(config.edge.shutdown_timeout),
                             _drain(sessions, config.edge.shutdown_timeout),
                             *([grpc_ingress.drain()] if grpc_ingress is not None else []))
        if grpc_ingress is not None:
            await grpc_ingress.close()
        await state.sockets.close_all()
        beat.cancel()  # deletes the registry entry
        await asyncio.gather(beat, return_exceptions=True)
        await runner.cleanup()
