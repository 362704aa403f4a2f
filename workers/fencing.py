"""Fencing: a worker that has lost NATS stops generating.

A worker cut from NATS cannot deliver, and once its streams move elsewhere two
generators would run. So it cancels every job (closing the backend response)
and starts none until NATS is back. The loss is known with no traffic per
stream: the client's own PINGs (``nats.max_pings_out`` unanswered) or a closed
socket start :data:`GRACE`, and :meth:`Fence.watch` polls ``is_connected`` every
:data:`POLL` s in case the callback is late; a reconnect within the grace (to
another cluster node) keeps the jobs.

Bound: backend calls stop at most ``ping_interval x (max_pings_out + 1) + GRACE
+ POLL`` after a silent cut. A fenced job does nothing more on NATS (no usage,
error, ack or nak); JetStream redelivers it. Unfenced on reconnect.
Docs: docs/reliability.md#partitions.
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
