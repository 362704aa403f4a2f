"""Many sessions' messages in one NATS message: the worker -> edge hot path.

:class:`Outbox` collects what a worker's jobs send towards each edge during one
event-loop iteration (or up to ``worker.coalesce_delay``) and publishes it as
one message on the edge's mux subject::

    [VERSION, Kind.MUX, request_id, message, request_id, message, ...]

Each ``message`` is a complete session message, so the per-session protocol is
unchanged; only the transport is shared. Invariants: one request's messages
reach its edge in put order; no message waits longer than ``delay`` plus one
loop iteration (one timer per batch, not per stream); a batch is cut at
``max_bytes`` (a larger message goes alone). Docs: docs/architecture.md#flow-control.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack

from tidegate.errors import ProtocolError
from tidegate.wire.protocol import VERSION, Kind

log = logging.getLogger("tidegate.mux")

_pack = msgpack.Packer().pack  # one packer per process, like protocol's
_FRAME_OVERHEAD = 40  # request id (24 hex) and msgpack framing, per message

Publish = Callable[[str, bytes], Any]  # NATS Client.publish (a coroutine function)


def batch_limit(configured: int, max_payload: int) -> int:
    """The byte bound for a batch: ``worker.coalesce_bytes``, but under the
    server's ``max_payload`` (a batch over it would be refused and its
    messages lost), with room for the envelope and one frame's estimate."""
    return max(1, min(configured, max_payload - 1024))


class Outbox:
    """Coalesces session messages per destination subject, one NATS message
    per subject per loop iteration. ``put`` is synchronous: the caller's
    sequence number and its place in the batch are assigned with no ``await``
    in between, which is what keeps the wire order the sequence order."""

    def __init__(self, publish: Publish, max_bytes: int = 128 << 10,
                 delay: float = 0.0) -> None:
        self._publish = publish
        self._max_bytes = max_bytes
        self._delay = delay  # the latency budget: how long a batch may wait for more
        self._hurry = 0  # flush() calls waiting: no batch waits out the budget
        self._open: dict[str, list[Any]] = {}  # subject -> the batch being filled
        self._sizes: dict[str, int] = {}
        self._full: list[tuple[str, list[Any]]] = []  # cut at max_bytes, in order
        self._wake: asyncio.Future[None] | None = None
        self._linger: asyncio.Future[None] | None = None  # set while a batch waits
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self.published = 0  # NATS messages sent (tests and benchmarks read these)
        self.frames = 0

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tidegate-mux-outbox")

    def put(self, subject: str, request_id: str, message: bytes) -> None:
        batch = self._open.get(subject)
        size = len(message) + _FRAME_OVERHEAD
        if batch is None:
            # The iteration's first message for this subject. Only now can the
            # outbox have been idle (the flusher waits only when nothing is
            # open), so only now does it need waking: later puts skip both.
            batch = self._open[subject] = [VERSION, Kind.MUX]
            self._sizes[subject] = 0
            self._idle.clear()
            wake = self._wake
            if wake is not None and not wake.done():
                wake.set_result(None)
        elif self._sizes[subject] + size > self._max_bytes:
            self._full.append((subject, batch))
            batch = self._open[subject] = [VERSION, Kind.MUX]
            self._sizes[subject] = 0
            linger = self._linger
            if linger is not None and not linger.done():
                linger.set_result(None)  # a full batch does not wait out the budget
        batch.append(request_id)
        batch.append(message)
        self._sizes[subject] += size

    async def flush(self) -> None:
        """Return once everything put so far has been handed to NATS (before
        closing the connection: drain loses nothing)."""
        if self._task is None or self._task.done():
            await self._publish_all()
            return
        # Whoever flushes waits for no budget: neither the wait under way nor
        # one the flusher is about to start.
        self._hurry += 1
        try:
            if self._linger is not None:
                _settle(self._linger)
            await self._idle.wait()
        finally:
            self._hurry -= 1

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._open and not self._full:
                self._idle.set()
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
            if self._delay and not self._full and not self._hurry:
                # Wait out the latency budget (or a batch filling up) for other
                # streams' messages to join this one.
                linger = self._linger = loop.create_future()
                timer = loop.call_later(self._delay, _settle, linger)
                await linger
                timer.cancel()
                self._linger = None
            # Let the rest of this loop iteration's ready callbacks (other jobs
            # woken by the same epoll round) add to the batch first.
            await asyncio.sleep(0)
            await self._publish_all()

    async def _publish_all(self) -> None:
        batches = self._full
        if self._open:
            batches.extend(self._open.items())
            self._open = {}
            self._sizes = {}
        self._full = []
        await self._send(batches)

    async def _send(self, batches: list[tuple[str, list[Any]]]) -> None:
        for subject, batch in batches:
            try:
                await self._publish(subject, _pack(batch))
            except Exception as exc:  # connection closed or draining: the edge's
                # worker-lost timer and the job's ack timeout take it from here
                log.warning("could not publish %d messages to %s: %s",
                            (len(batch) - 2) // 2, subject, exc)
                continue
            self.published += 1
            self.frames += (len(batch) - 2) // 2


# A JetStream publish that returns once the stream stored it (subject,
# payload, Nats-Msg-Id), or raises once it gives up.
StoredPublish = Callable[[str, bytes, str], Awaitable[Any]]


class StoredOutbox(Outbox):
    """An :class:`Outbox` whose batches JetStream acknowledges: a resumable
    stream's log (``workers.resumable``). A batch for a subject goes out only
    once the one before it was stored, so the log holds every entry once, in
    order, even across an election that drops what reaches a leaderless
    stream: the publish is retried (``tidegate.broker.patient``) under its
    ``Nats-Msg-Id``, and what is put meanwhile waits for the next batch. The
    wait costs a round trip per batch, not per message; subjects go out
    concurrently; the live path (another outbox) never waits on it."""

    def __init__(self, publish: StoredPublish, max_bytes: int = 128 << 10) -> None:
        super().__init__(_no_plain_publish, max_bytes)
        self._stored = publish
        self._ids = f"{secrets.token_hex(6)}."  # this outbox's Nats-Msg-Ids
        self._count = 0

    async def _send(self, batches: list[tuple[str, list[Any]]]) -> None:
        by_subject: dict[str, list[list[Any]]] = {}
        for subject, batch in batches:
            by_subject.setdefault(subject, []).append(batch)
        await asyncio.gather(*(self._send_in_order(subject, in_order)
                               for subject, in_order in by_subject.items()))

    async def _send_in_order(self, subject: str, batches: list[list[Any]]) -> None:
        for batch in batches:
            self._count += 1
            try:
                await self._stored(subject, _pack(batch), f"{self._ids}{self._count}")
            except Exception as exc:  # out of patience, or the connection is closing:
                # a reader of this log ends at the gap (stream_gap), at once
                log.warning("could not store %d messages to %s: %s",
                            (len(batch) - 2) // 2, subject, exc)
                continue
            self.published += 1
            self.frames += (len(batch) - 2) // 2


async def _no_plain_publish(subject: str, payload: bytes) -> None:
    raise AssertionError("a StoredOutbox publishes through its StoredPublish")


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def decode_mux(data: bytes) -> list[tuple[str, bytes]]:
    """``(request_id, message)`` pairs of a mux message, in order. All or
    nothing: raises :class:`ProtocolError` if any part is malformed (the
    sessions it was for then see a sequence gap, a clear error)."""
    try:
        t = msgpack.unpackb(data)
    except Exception as exc:
        raise ProtocolError(f"mux message is not msgpack: {exc}") from exc
    if not isinstance(t, list) or len(t) < 2 or len(t) % 2:
        raise ProtocolError("mux message is not a [version, kind, id, message, ...] array")
    if t[0] != VERSION:
        raise ProtocolError(f"unsupported mux envelope version {t[0]!r}")
    if t[1] != Kind.MUX:
        raise ProtocolError(f"unexpected message kind {t[1]!r} on a mux subject")
    frames = list(zip(t[2::2], t[3::2], strict=True))
    for request_id, message in frames:
        if type(request_id) is not str or type(message) is not bytes:
            raise ProtocolError("mux frame is not (str, bytes)")
    return frames
