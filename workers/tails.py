"""The kept tails of jobs that just ended, for a retransmit that comes late.

A job keeps every message its edge has not acknowledged (``SendWindow``) so
that a message lost in transit can be sent again (``Retransmit``). When the
job ends, its last messages (the final chunks, ``Done`` or ``Error``) are
usually not acknowledged yet, and the edge may still find one missing: a
gap seen when ``Done`` arrives, or a ``Done`` lost outright (the edge asks
when its worker has been silent for longer than a heartbeat). So the pool
keeps each ended job's unacknowledged tail here for a while, bounded in time
(the edge's own give-up limit) and in bytes (oldest dropped first): under a
load where the bound bites, a late retransmit finds nothing and the stream
ends with ``stream_gap``, as it did before retransmits existed.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from tidegate.config import Config
from tidegate.errors import ProtocolError
from tidegate.wire.protocol import Done, Error, Request, decode_session


def tails_for(config: Config) -> Tails:
    """A worker's tails, kept as long as an edge waits before it gives up on
    a silent worker (``session.heartbeat_interval`` x ``worker_lost_after``)."""
    session = config.session
    return Tails(session.heartbeat_interval * session.worker_lost_after)


class Tails:
    def __init__(self, ttl: float, max_bytes: int = 16 << 20) -> None:
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.bytes = 0
        # request id -> (expires at, request, (seq, message) kept, their bytes)
        self._tails: OrderedDict[str, tuple[float, Request, list[tuple[int, bytes]], int]] = (
            OrderedDict())

    def __len__(self) -> int:
        return len(self._tails)

    def keep(self, request: Request, messages: list[tuple[int, bytes]],
             now: float | None = None) -> None:
        """Keep an ended job's unacknowledged ``(seq, message)`` pairs."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if not messages:
            return
        size = sum(len(m) for _, m in messages)
        if size > self.max_bytes:
            return
        self._tails.pop(request.id, None)
        self._tails[request.id] = (now + self.ttl, request, messages, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, _, dropped) = self._tails.popitem(last=False)
            self.bytes -= dropped

    def since(self, request_id: str, seq: int,
              now: float | None = None) -> tuple[Request, list[bytes]] | None:
        """The request and its kept messages from ``seq`` on, if it ended lately."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        kept = self._tails.get(request_id)
        if kept is None:
            return None
        return kept[1], [m for s, m in kept[2] if s >= seq]

    def ended(self, request_id: str) -> bool:
        """Whether ``request_id``'s job ran to its end here lately: its tail's
        last message is its end (``Done`` or ``Error``). A job cut off (fenced,
        a copy dropped) keeps no end in its tail."""
        kept = self.since(request_id, 0)
        if kept is None or not kept[1]:
            return False
        try:
            return isinstance(decode_session(kept[1][-1]), (Done, Error))
        except ProtocolError:
            return False

    def _expire(self, now: float) -> None:
        tails = self._tails
        while tails:
            request_id, (expires, _, _, size) = next(iter(tails.items()))
            if expires > now:
                return
            del tails[request_id]
            self.bytes -= size
