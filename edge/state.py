"""What every edge route shares: the process's :class:`EdgeState` (config,
NATS, keys, sessions, the relay context) under the aiohttp app key
:data:`STATE`, the session clock and TCP keepalive on client sockets.

Below the routes (``edge.app``, ``edge.ws``, ``edge.background``,
``edge.files``, ``edge.batches``) and above what they use, so none of them
imports another route module to reach it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import weakref
from dataclasses import dataclass, field

from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from edge.auth import KeyTable
from edge.logreader import StreamLog
from edge.relay import Publisher, RelayContext
from edge.session import SessionTable
from edge.ws_hub import WsHub
from tidegate.broker.link import Link, grace
from tidegate.broker.liveness import WorkerWatch
from tidegate.config import Config, EdgeConfig, ModelConfig
from tidegate.control.tenants import TenantTable
from tidegate.telemetry import telemetry
from tidegate.telemetry.telemetry import Telemetry
from tidegate.wire.subjects import Subjects

log = logging.getLogger("tidegate.edge")


class NatsPublisher(Publisher):
    def __init__(self, nc: NATS, subjects: Subjects) -> None:
        self._nc = nc
        self._subjects = subjects

    async def publish(self, subject: str, payload: bytes) -> None:
        await self._nc.publish(subject, payload)

    async def tombstone(self, request_id: str, reason: str) -> None:
        # A KV put without waiting for JetStream's ack: the tombstone is the
        # safety net behind the direct Cancel, and a mass disconnect (10,000
        # clients of an edge at once) must not wait on 10,000 acked writes: the
        # bench saw them time out after nats.request_timeout, each holding its
        # handler that long.
        await self._nc.publish(self._subjects.cancel_key(request_id), reason.encode())


@dataclass(slots=True)
class EdgeState:
    """Everything the handlers share; one per edge process."""

    config: Config
    edge_id: str
    nc: NATS
    js: JetStreamContext
    keys: KeyTable
    sessions: SessionTable
    models: dict[str, ModelConfig] = field(init=False)
    relay: RelayContext = field(init=False)
    draining: bool = False
    telemetry: Telemetry = field(default_factory=telemetry.get)
    sockets: WsHub = field(default_factory=WsHub)  # open WebSockets (edge/ws.py)
    tenants: TenantTable = field(default_factory=TenantTable)  # followed from <P>_TENANTS
    # The reader of resumable streams' logs (edge.logreader): SSE resume here,
    # and every other reader (WebSocket, Responses, batch) uses it too.
    streamlog: StreamLog = field(init=False)

    def __post_init__(self) -> None:
        self.models = self.config.model_index()
        # One liveness probe per edge, per followed worker (tidegate.broker.liveness).
        watch = WorkerWatch(self.nc, self.config.session.liveness_interval,
                            self.config.worker.fetch_timeout)
        self.streamlog = StreamLog(self.nc, self.js, self.config)
        self.relay = RelayContext(self.config, NatsPublisher(self.nc, self.config.nats.subjects),
                                  Link(self.nc, grace(self.config.nats)),
                                  watch if watch.enabled else None, self.models, self.streamlog)


STATE: web.AppKey[EdgeState] = web.AppKey("tidegate_edge_state", EdgeState)


def session_tick(config: Config) -> float:
    """How often a session's clock checks (deadlines, pings, keepalive acks)
    run: a third of a heartbeat keeps pings on time, and a long tick keeps
    10,000 idle streams from costing the edge a core's worth of wakeups."""
    return min(max(config.session.heartbeat_interval / 3, 0.05), 5.0)


# Client transports whose keepalive is set: a keep-alive connection carries
# many requests, and the options need setting once (four syscalls saved each).
_keepalive_set: weakref.WeakSet[asyncio.BaseTransport] = weakref.WeakSet()


def set_keepalive(transport: asyncio.BaseTransport | None, config: EdgeConfig) -> None:
    """TCP keepalive on the client socket, so a peer that vanished without a
    FIN (NAT timeout, pulled cable) is noticed even on an idle stream, and
    middleboxes see traffic. Linux option names; elsewhere SO_KEEPALIVE only."""
    if transport is None or not config.keepalive_idle or transport in _keepalive_set:
        return
    try:
        _keepalive_set.add(transport)
    except TypeError:  # a transport without weakrefs: configure it every request
        pass
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, config.keepalive_idle)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, config.keepalive_interval)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, config.keepalive_count)
    except OSError as exc:  # e.g. a Unix socket
        log.debug("cannot set keepalive: %s", exc)
