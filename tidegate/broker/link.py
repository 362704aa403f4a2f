"""Whether this process's NATS link is up, and for how long it has not been.

The edge asks once per session tick per stream (``edge/relay.py``): an edge cut
from NATS gets nothing from its workers, so after :attr:`Link.grace` its streams
are released (a resumable one with ``event: reconnect``, any other with a
retryable ``broker_unavailable``) instead of waiting out the worker-silence limit.

Invariant: the client's state is read, not a callback's. nats-py marks the
connection RECONNECTING the moment it gives up on it, and a reconnect to another
cluster node within the grace hides the blip. Docs: docs/reliability.md.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS

from tidegate.config import NatsConfig


def stale_after(cfg: NatsConfig) -> float:
    """The longest a silent cut goes unnoticed by the client's PINGs."""
    return cfg.ping_interval * (cfg.max_pings_out + 1)


def grace(cfg: NatsConfig) -> float:
    """How long an edge's link may be down before its streams are released:
    ``max_pings_out`` PINGs' spacing, far more than a reconnect to a healthy
    node takes (0.5 s after a node's death). With :func:`stale_after`, the
    bound on a client's wait after a silent cut is ``ping_interval x
    (2 x max_pings_out + 1)`` plus one session tick (5 s + 5 s by default)."""
    return cfg.ping_interval * cfg.max_pings_out


class Link:
    """The NATS link of one process, as seen at the session clock's ticks."""

    __slots__ = ("down_since", "grace", "nc")

    def __init__(self, nc: NATS | None, grace: float) -> None:
        self.nc = nc
        self.grace = grace  # see grace()
        self.down_since = 0.0

    @property
    def epoch(self) -> int:
        """How many times the client reconnected (a change: something in
        flight through the old connection may be lost)."""
        nc = self.nc
        return int(nc.stats["reconnects"]) if nc is not None else 0

    def down_for(self, now: float) -> float:
        """Seconds the link has been down at ``now`` (0 while it is up)."""
        nc = self.nc
        if nc is None or nc.is_connected or nc.is_closed:
            self.down_since = 0.0  # closed: the process is stopping, not cut
            return 0.0
        if not self.down_since:
            self.down_since = now
        return now - self.down_since

    def lost(self, now: float) -> bool:
        """Down for longer than the grace: streams are to be released."""
        down = self.down_for(now)
        return down > 0 and down >= self.grace
