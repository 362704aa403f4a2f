"""The ``<P>_EDGES`` KV bucket: live edges and the client connections they hold.

Every edge puts one entry (key: its edge id, value: JSON) every
:data:`HEARTBEAT` seconds: open requests (SSE and HTTP), open WebSockets and
the generations running on them. The bucket's TTL is :data:`TTL`, so an edge
that died disappears within that time; one that stops cleanly deletes its
entry. ``tidegate status`` shows the counts per edge and in all. Advisory
(a few seconds old at most), as the workers registry is; nothing routes by it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.config import Config
from tidegate.control import registry

log = logging.getLogger("tidegate.edge")

HEARTBEAT = 5.0  # seconds between an edge's puts
TTL = 15.0  # three missed heartbeats


def bucket_name(config: Config) -> str:
    return f"{config.nats.subjects.prefix.upper()}_EDGES"


@dataclass(frozen=True, slots=True)
class EdgeInfo:
    edge_id: str
    host: str = ""
    pid: int = 0
    started: float = 0.0  # unix seconds
    updated: float = 0.0  # unix seconds of this heartbeat
    streams: int = 0  # open generation requests, SSE and WebSocket alike (sessions)
    ws_connections: int = 0
    ws_generations: int = 0
    draining: bool = False

    def encode(self) -> bytes:
        return json.dumps({
            "edge_id": self.edge_id, "host": self.host, "pid": self.pid,
            "started": self.started, "updated": self.updated, "streams": self.streams,
            "ws_connections": self.ws_connections, "ws_generations": self.ws_generations,
            "draining": self.draining}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> EdgeInfo:
        raw: dict[str, Any] = json.loads(data)
        return cls(edge_id=str(raw["edge_id"]), host=str(raw.get("host", "")),
                   pid=int(raw.get("pid", 0)), started=float(raw.get("started", 0.0)),
                   updated=float(raw.get("updated", 0.0)), streams=int(raw.get("streams", 0)),
                   ws_connections=int(raw.get("ws_connections", 0)),
                   ws_generations=int(raw.get("ws_generations", 0)),
                   draining=bool(raw.get("draining", False)))


def local_info(edge_id: str, started: float, *, streams: int, ws_connections: int,
               ws_generations: int, draining: bool) -> EdgeInfo:
    return EdgeInfo(edge_id=edge_id, host=socket.gethostname(), pid=os.getpid(),
                    started=started, updated=time.time(), streams=streams,
                    ws_connections=ws_connections, ws_generations=ws_generations,
                    draining=draining)


async def ensure_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    return await registry.ensure_bucket(js, config, bucket_name(config),
                                        "tidegate: live edges and their connections", TTL)


async def heartbeat(kv: KeyValue, snapshot: Callable[[], EdgeInfo],
                    interval: float = HEARTBEAT) -> None:
    """Put ``snapshot()`` every ``interval`` until cancelled, then delete the
    entry (:func:`tidegate.control.registry.heartbeat`)."""
    await registry.heartbeat(kv, snapshot, lambda i: i.edge_id, interval, "edge")


async def read_all(kv: KeyValue, max_age: float = TTL) -> list[EdgeInfo]:
    """Every live edge, by edge id, once each (the newest entry of a key;
    see :func:`tidegate.control.registry.read_live`)."""
    return await registry.read_live(kv, EdgeInfo.decode, lambda i: i.edge_id, max_age, "edge")


def summary(edges: list[EdgeInfo], now: float) -> dict[str, Any]:
    """What ``tidegate status`` shows: per edge and the totals."""
    return {
        "total": {"edges": len(edges), "streams": sum(e.streams for e in edges),
                  "ws_connections": sum(e.ws_connections for e in edges),
                  "ws_generations": sum(e.ws_generations for e in edges)},
        "edges": [{"edge_id": e.edge_id, "host": e.host, "pid": e.pid,
                   "uptime_s": round(max(0.0, now - e.started), 1),
                   "heartbeat_age_s": round(max(0.0, now - e.updated), 1),
                   "streams": e.streams, "ws_connections": e.ws_connections,
                   "ws_generations": e.ws_generations, "draining": e.draining}
                  for e in edges],
    }
