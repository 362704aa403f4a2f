"""Per-request session state at the edge: the mailbox the NATS callback fills.

One wildcard subscription per edge (``<p>.out.<edge>.*``) receives every open
request's messages; :class:`SessionTable` routes each to its :class:`Session`
by the subject's last token, and unpacks the workers' mux batches
(``tidegate.wire.mux``) the same way. Invariant: the edge is subscribed before
it publishes, so no early answer is lost.

Hot path: a session whose relay keeps up installs a ``direct`` writer, and a
chunk with nothing queued before it is written from the NATS callback without
waking the relay; anything else queues and wakes it, so the socket gets chunks
in sequence order. A session wakes for messages or its periodic tick (timeouts,
``: ping``): no timer per chunk. Docs: docs/lifecycle.md#the-edges-relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tidegate.broker.liveness import WorkerWatch
from tidegate.errors import ApiError, ProtocolError
from tidegate.telemetry.untrusted import BadInput
from tidegate.wire.mux import decode_mux
from tidegate.wire.protocol import Chunk, SessionMessage, decode_session
from tidegate.wire.subjects import MUX_TOKEN

log = logging.getLogger("tidegate.edge")
#: Broker input this edge dropped (counted, logged at a rate limit).
BAD_INPUT = BadInput("edge", log)


class Session:
    __slots__ = ("_loop", "_pending", "_tick_handle", "_tick_interval", "_waiter",
                 "aborted", "direct", "lost", "request_id", "resumable", "tenant", "ticked",
                 "watch", "worker")

    def __init__(self, request_id: str, tick_interval: float, tenant: str = "") -> None:
        self.request_id = request_id
        self.tenant = tenant  # who may cancel it (POST /v1/streams/{id}/cancel)
        self.resumable = False  # set by its relay: at drain, told to reconnect
        self._loop = asyncio.get_running_loop()
        # A list, not a deque: it is only appended to and taken whole, and an
        # empty deque is 760 bytes (a list 56), on each of 10,000 idle streams.
        self._pending: list[SessionMessage] = []
        self._waiter: asyncio.Future[None] | None = None
        self._tick_interval = tick_interval
        self.ticked = False
        self.aborted: ApiError | None = None
        # Writes an in-order chunk to the client at once; False = not now, queue it.
        self.direct: Callable[[Chunk], bool] | None = None
        self._tick_handle = self._loop.call_later(tick_interval, self._on_tick)
        # The worker this session streams from (its control subject), while
        # the edge's WorkerWatch follows it; ``lost``: that worker is known
        # dead (tidegate.broker.liveness), for the relay to act on at its next wake-up.
        self.watch: WorkerWatch | None = None
        self.worker = ""
        self.lost = ""

    def follow(self, watch: WorkerWatch, control: str) -> None:
        """Stream from the worker at ``control`` (and stop following any other)."""
        if control == self.worker and watch is self.watch:
            return
        self.unfollow()
        self.watch, self.worker = watch, control
        watch.follow(self, control)

    def unfollow(self) -> None:
        if self.watch is not None and self.worker:
            self.watch.unfollow(self, self.worker)
        self.watch, self.worker = None, ""

    def worker_lost(self, control: str) -> None:
        """The edge's WorkerWatch found the worker at ``control`` gone."""
        if control != self.worker:
            return
        self.watch, self.worker = None, ""  # the watch has forgotten it already
        self.lost = control
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def feed(self, message: SessionMessage) -> None:
        direct = self.direct
        if (direct is not None and not self._pending and type(message) is Chunk
                and direct(message)):
            return
        self._pending.append(message)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def abort(self, error: ApiError) -> None:
        """End the request from the edge's side (e.g. shutdown): the relay
        raises ``error`` at its next wake-up and cancels the upstream work."""
        self.aborted = error
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _on_tick(self) -> None:
        self.ticked = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        self._tick_handle = self._loop.call_later(self._tick_interval, self._on_tick)

    async def wait(self) -> None:
        """Return once there are messages or a tick has passed."""
        if self._pending or self.ticked or self.aborted or self.lost:
            return
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take_tick(self) -> bool:
        """Whether a tick passed since the last call (and clear it). Separate
        from :meth:`take`: a tick that coincides with messages must still run
        the clock checks, after the messages are handled."""
        ticked, self.ticked = self.ticked, False
        return ticked

    def take(self) -> list[SessionMessage]:
        """Everything received since the last call, oldest first."""
        messages = self._pending
        if not messages:
            return []
        self._pending = []
        return messages

    def close(self) -> None:
        self._tick_handle.cancel()
        self.unfollow()


class SessionTable:
    """Request id -> open session, fed by the edge's one inbox subscription."""

    def __init__(self, inbox_prefix: str) -> None:
        # "<p>.out.<edge>." - the request id is everything after it.
        self._prefix_len = len(inbox_prefix)
        self._sessions: dict[str, Session] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, request_id: str, tick_interval: float, tenant: str = "") -> Session:
        session = Session(request_id, tick_interval, tenant)
        self._sessions[request_id] = session
        self._empty.clear()
        return session

    def get(self, request_id: str) -> Session | None:
        return self._sessions.get(request_id)

    def open_sessions(self) -> list[Session]:
        return list(self._sessions.values())

    def close(self, session: Session) -> None:
        session.close()
        self._sessions.pop(session.request_id, None)
        if not self._sessions:
            self._empty.set()

    async def wait_empty(self, grace: float) -> bool:
        """True once no request is open, False if ``grace`` seconds passed first."""
        try:
            async with asyncio.timeout(grace):
                await self._empty.wait()
        except TimeoutError:
            return False
        return True

    def dispatch(self, subject: str, data: bytes) -> None:
        request_id = subject[self._prefix_len:]
        if request_id != MUX_TOKEN:
            self._deliver(request_id, data)
            return
        try:
            frames = decode_mux(data)
        except ProtocolError as exc:
            # The sessions it was for see a sequence gap, or go silent and time out.
            BAD_INPUT.drop("mux", "malformed", str(exc))
            return
        for request_id, message in frames:
            self._deliver(request_id, message)

    def _deliver(self, request_id: str, data: bytes) -> None:
        session = self._sessions.get(request_id)
        if session is None:
            # Late message for a finished request (e.g. a heartbeat racing the
            # end of the stream). The worker learns of the end through the
            # cancel that closing the request sent, if any.
            return
        try:
            session.feed(decode_session(data))
        except ProtocolError as exc:
            BAD_INPUT.drop("session", "malformed", f"{request_id}: {exc}")
        except (TypeError, ValueError, AttributeError) as exc:
            # Framed right, typed wrong, caught by the direct chunk writer
            # (a try costs nothing until it raises: the chunk path is unchanged).
            BAD_INPUT.drop("session", "wrong_types", f"{request_id}: {exc!r}")
