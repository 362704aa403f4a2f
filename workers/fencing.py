"""Fencing: a worker that has lost NATS stops generating.

A worker cut from NATS (a partition, a dead switch port, a link that still
sends but no longer receives) cannot deliver what its backends generate: its
chunks, heartbeats and acks go nowhere, and once the edges or JetStream give
its streams to another worker, two generators would run, one of them burning
a GPU for nobody. So the worker fences itself: every job it runs is cancelled
(which closes the backend response, so the backend aborts the generation and
frees its KV cache), and it starts no new one until NATS is back.

How the loss is known (no extra traffic per stream):

* the NATS client's own PINGs (``nats.ping_interval``): ``nats.max_pings_out``
  unanswered and the client declares the connection stale, drops it and
  reconnects; its disconnect callback (``on_link(False)``) starts the
  :data:`GRACE`. A link that sends but does not receive fails the same way:
  the PONGs never come;
* a closed socket (a node that died, a RST) starts the grace at once,
  through the same callback;
* still disconnected when the grace ends: fenced. A worker whose NATS node
  died reconnects to another within milliseconds (25 ms measured) and keeps
  its jobs: the edges ask for what was lost in transit (Retransmit) and the
  streams go on. Fencing at the disconnect itself cancelled every job of a
  worker on a killed node (tests/test_nats_cluster.py);
* :meth:`Fence.watch` also polls ``is_connected`` every :data:`POLL` s, so a
  disconnect whose callback is late (nats-py closes the old transport before
  calling it, which can wait on unsent bytes) still starts the grace.

Bound (docs/reliability.md, "Partitions"): a worker stops its backend calls at
most ``nats.ping_interval x (nats.max_pings_out + 1) + GRACE + POLL`` after
its link was cut silently (4.75 s by default), ``GRACE`` after its socket
closed when no reconnect follows.

What a fenced job does (``FENCED``, workers/job.py): nothing more on NATS. No
usage record, no error event, no ack or nak: none of it could arrive, and
what arrived after the heal would be stale (the edge has given up on this
worker, or the stream goes on elsewhere). JetStream redelivers the job after
``worker.ack_wait``; the edge follows the rules for a lost worker.

Unfenced when the client has reconnected: a reconnect is a fresh handshake
(CONNECT, PING, PONG), so the new link works both ways.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS

log = logging.getLogger("tidegate.worker")

FENCED = "fenced"  # the cancel reason of a job stopped by the fence
POLL = 0.25  # seconds between two looks at the client's state
# How long a disconnected worker keeps its jobs, waiting for a reconnect (to
# another node of the cluster) before it fences.
GRACE = 1.5


class Fence:
    """Whether this worker may run jobs: its NATS link works both ways.

    ``on_fence`` is called once per loss (the pool cancels every job);
    :attr:`fenced` is what a job about to start checks.
    """

    def __init__(self, on_fence: Callable[[str], None],
                 on_back: Callable[[], None] | None = None) -> None:
        self.on_fence = on_fence
        self.on_back = on_back  # called at every reconnect (the pool resends unacked output)
        self.fenced = False
        self.since = 0.0  # monotonic time of the last fencing
        self.fencings = 0
        self.down_since: float | None = None  # the link's loss, while it lasts

    def on_link(self, up: bool) -> None:
        """The NATS client's disconnect (False) / reconnect (True) callback."""
        if up:
            self.down_since = None
            self.lift()
            if self.on_back is not None:
                self.on_back()
        elif self.down_since is None:
            self.down_since = time.monotonic()

    def check(self, now: float) -> None:
        """Fence if the link has been down for the whole :data:`GRACE`."""
        if self.down_since is not None and now - self.down_since >= GRACE:
            self.fence(f"nats disconnected for {now - self.down_since:.1f}s")

    def fence(self, why: str) -> None:
        if self.fenced:
            return
        self.fenced = True
        self.since = time.monotonic()
        self.fencings += 1
        log.warning("fenced (%s): stopping every job, taking no new one until NATS is back",
                    why)
        self.on_fence(why)

    def lift(self) -> None:
        if self.fenced:
            self.fenced = False
            log.info("fence lifted after %.1fs: NATS is back", time.monotonic() - self.since)

    async def watch(self, nc: NATS) -> None:
        """Fence whenever the client has not been connected for the grace
        (until cancelled)."""
        while True:
            await asyncio.sleep(POLL)
            if not nc.is_connected and not nc.is_closed:
                self.on_link(False)  # a late or missed callback: the grace starts now
                self.check(time.monotonic())
            elif nc.is_connected and (self.fenced or self.down_since is not None):
                self.on_link(True)
