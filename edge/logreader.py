"""The edge's reader of resumable streams: replay, then live tail, from any edge.

The one API of every resumable reader (SSE and WebSocket resume, background
responses, batch results): ``async with state.streamlog.read(request_id,
tenant, after=n) as reader``, then ``reader.open`` (the :class:`LogOpen`) and
``async for item in reader``: :class:`LogEvent` s with ``id > after``, each
once, in order, then exactly one :class:`LogEnd`. Unknown, expired or another
tenant's stream: 404 ``stream_not_found``.

Invariants: replay and tail come from one ordered consumer, so the seam is
exact; ``next_unless_draining`` never hands out an item after the drain, so
``reader.last_id`` is the last event the client got; a read is never cancelled
(the fetch task outlives a ``next`` that timed out). Inside the ``async with``
the reader is attached to the worker. Docs: docs/resume.md#the-log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Final

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from tidegate.broker import patient
from tidegate.config import Config
from tidegate.errors import ApiError, ProtocolError
from tidegate.wire import streamlog
from tidegate.wire.protocol import Attach, Detach, ErrorInfo
from tidegate.wire.streamlog import LiveTail, LogCursor, LogEnd, LogEvent, LogItem, LogOpen

log = logging.getLogger("tidegate.edge")

# The reader's subscription queue: the backstop between JetStream and a slow
# client. Past it the client library drops messages and the ordered consumer
# restarts after the last one it handed over: nothing is lost, and nothing
# beyond this piles up in the edge.
_PENDING_MSGS = 4096
_PENDING_BYTES = 16 << 20


class Draining:
    """The type of :data:`DRAINING`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DRAINING"


#: What :meth:`LogReader.next_unless_draining` answers once the edge drains.
DRAINING: Final = Draining()


def not_found() -> ApiError:
    return ApiError(404, "No stream with this id (it may have expired, or was not resumable).",
                    type="not_found_error", code="stream_not_found")


def valid_id(request_id: str) -> bool:
    """Request ids are 24 lower-case hex digits (96 random bits)."""
    return len(request_id) == 24 and all(c in "0123456789abcdef" for c in request_id)


class StreamLog:
    """The stream log as this edge reads it; one per edge process."""

    def __init__(self, nc: NATS, js: JetStreamContext, config: Config) -> None:
        self.nc = nc
        self.js = js
        self.config = config
        self.stream = streamlog.stream_name(config.nats.subjects)
        # Set when the edge drains: readers end with the reconnect event.
        self.draining = asyncio.Event()

    def drain(self) -> None:
        self.draining.set()

    async def lookup(self, request_id: str, tenant: str) -> LogOpen:
        """The stream's :class:`LogOpen`, if it exists and is ``tenant``'s;
        else 404 ``stream_not_found``."""
        if not valid_id(request_id):
            raise not_found()
        subject = streamlog.subject(self.config.nats.subjects, request_id)
        try:
            raw = await self.js.get_msg(self.stream, seq=1, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            raise not_found() from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise ApiError(503, f"The stream log is unavailable ({type(exc).__name__}); "
                                "retry later.", type="server_error",
                           code="broker_unavailable", retryable=True, retry_after=2) from None
        try:
            first = streamlog.decode_entry(raw.data or b"")[0]
        except (ProtocolError, IndexError):
            raise not_found() from None
        if not isinstance(first, LogOpen) or first.tenant != tenant:
            raise not_found()
        return first

    def read(self, request_id: str, tenant: str, after: int = 0) -> LogReader:
        return LogReader(self, request_id, tenant, after)

    async def refill(self, request_id: str, tail: LiveTail) -> int:
        """Store in ``request_id``'s log what its client got live and the log
        lacks (``tail``: the relay's last messages), once its worker is dead;
        how many messages that was. A dead worker writes no more, so the
        log's last message says where to start. The edge's hand-back (a
        LogHandBack, then the job's -NAK) comes after: the next worker
        continues the text the client has. Raises what JetStream raised."""
        subject = streamlog.subject(self.config.nats.subjects, request_id)
        try:
            raw = await self.js.get_last_msg(self.stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return 0  # no log: nothing to fill
        logged = streamlog.last_seq(streamlog.decode_entry(raw.data or b""))
        missing = tail.after(logged)
        if not missing:
            if missing is None:
                log.warning("request %s: its log lags its client by more than the %d messages "
                            "the edge keeps (or lacks this delivery's start); a reader of it "
                            "ends at the gap", request_id, len(tail))
            return 0
        first = missing[0].seq
        payload = streamlog.batch(request_id, [m.encode() for m in missing])
        await patient.publish(self.js, self.nc, subject, payload,
                              {"Nats-Msg-Id": f"{request_id}.refill.{first}"},
                              self.config.edge.publish_patience)
        log.info("request %s: its worker died with the log %d message(s) behind the client; "
                 "stored them from seq %d", request_id, len(missing), first)
        return len(missing)


class LogReader:
    """One reader of one stream (see the module docstring)."""

    def __init__(self, log_: StreamLog, request_id: str, tenant: str, after: int) -> None:
        self._log = log_
        self.request_id = request_id
        self.tenant = tenant
        self.after = after
        self.reader_id = secrets.token_hex(8)
        self.cursor = LogCursor(after)
        self._psub: JetStreamContext.PushSubscription | None = None
        self._ready: deque[LogItem] = deque()
        self._attach: asyncio.Task[None] | None = None
        # The pending read of the next log message, kept across next() calls
        # that returned without it (a bound ran out, the edge drains).
        self._fetch: asyncio.Future[Msg] | None = None
        self._attached_to = ""
        self._last_entry = time.monotonic()
        self.open: LogOpen = LogOpen("", True, 0, 0, 0.0)
        self.last_id = after  # the id of the last event handed out

    async def __aenter__(self) -> LogReader:
        self.open = await self._log.lookup(self.request_id, self.tenant)
        self.cursor.open = self.open
        cfg = self._log.config
        sub = await self._log.js.subscribe(
            streamlog.subject(cfg.nats.subjects, self.request_id), stream=self._log.stream,
            ordered_consumer=True, deliver_policy=DeliverPolicy.ALL,
            idle_heartbeat=max(1.0, min(5.0, cfg.session.heartbeat_interval)),
            pending_msgs_limit=_PENDING_MSGS, pending_bytes_limit=_PENDING_BYTES)
        self._psub = sub
        self._attach = asyncio.create_task(self._keep_attached(),
                                           name=f"tidegate-attach-{self.request_id}")
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._fetch is not None:
            self._fetch.cancel()
            with contextlib.suppress(BaseException):
                await self._fetch
        if self._attach is not None:
            self._attach.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._attach
        if self._psub is not None:
            with contextlib.suppress(Exception):
                await self._psub.unsubscribe()
        if self._attached_to and not self.cursor.ended:
            with contextlib.suppress(Exception):
                await self._log.nc.publish(self._attached_to,
                                           Detach(self.request_id, self.reader_id).encode())

    def __aiter__(self) -> AsyncIterator[LogItem]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[LogItem]:
        while True:
            item = await self.next(None)
            assert item is not None
            yield item
            if isinstance(item, LogEnd):
                return

    async def next(self, within: float | None) -> LogItem | None:
        """The next item, or None when nothing came within ``within``
        seconds (``None``: wait as long as it takes; the silence limits below
        still end the stream). After the :class:`LogEnd`, raises
        ``StopAsyncIteration``."""
        item = await self._next(within, None)
        assert not isinstance(item, Draining)
        return item

    async def next_unless_draining(self, within: float | None) -> LogItem | Draining | None:
        """:meth:`next`, but :data:`DRAINING` once the edge drains: then no
        further item is handed out, so ``last_id`` stays the last event the
        caller got (and wrote), which the reconnect event names."""
        return await self._next(within, self._log.draining)

    async def _next(self, within: float | None,
                    stop: asyncio.Event | None) -> LogItem | Draining | None:
        deadline = None if within is None else time.monotonic() + within
        while not self._ready:
            if self.cursor.ended:
                raise StopAsyncIteration
            if stop is not None and stop.is_set():
                return DRAINING
            wait = self._silence_left()
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            if wait <= 0:
                if deadline is not None and time.monotonic() >= deadline:
                    return None
                self._ready.extend(self.cursor.fail(self._silence_error()))
                break
            msg = await self._receive(wait, stop)
            if msg is None:
                continue
            self._last_entry = time.monotonic()
            try:
                entries = streamlog.decode_entry(msg.data)
            except ProtocolError as exc:
                log.error("stream %s: malformed log entry: %s", self.request_id, exc)
                continue
            for entry in entries:
                self._ready.extend(self.cursor.feed(entry))
            if self.cursor.control and self.cursor.control != self._attached_to:
                await self._attach_now()
        if stop is not None and stop.is_set():
            return DRAINING  # the item stays unread: the client resumes from it
        item = self._ready.popleft()
        if isinstance(item, LogEvent):
            self.last_id = item.id
        return item

    async def _receive(self, wait: float, stop: asyncio.Event | None) -> Msg | None:
        """The next log message, or None when ``wait`` seconds passed or
        ``stop`` was set first. The fetch is never cancelled here: if it did
        not finish, the next call waits for the same one, so a message is
        neither lost nor taken by a read whose caller has gone."""
        fetch = self._fetch
        if fetch is None:
            assert self._psub is not None
            fetch = self._fetch = asyncio.ensure_future(self._psub.next_msg(timeout=None))
        if not fetch.done():
            if stop is None:
                await asyncio.wait((fetch,), timeout=wait)
            else:
                stopped = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait((fetch, stopped), timeout=wait,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopped.cancel()
            if not fetch.done():
                return None
        self._fetch = None
        return fetch.result()

    # -- silence limits, as the relay's ----------------------------------------

    def _silence_left(self) -> float:
        cfg = self._log.config
        now = time.monotonic()
        if self.cursor.requeued:  # back in JetStream: waits for a worker as a new one does
            return self._last_entry + cfg.edge.queue_timeout + cfg.session.heartbeat_interval - now
        if self.cursor.control:  # a worker runs it: heartbeats are logged
            limit = cfg.session.heartbeat_interval * cfg.session.worker_lost_after
            return self._last_entry + limit - now
        # Not started yet: as long as the edge waits for a worker, plus a margin
        # for the original edge to write its own end.
        waited = time.time() - self.open.created_ms / 1000
        return cfg.edge.queue_timeout + cfg.session.heartbeat_interval - waited

    def _silence_error(self) -> ErrorInfo:
        if self.cursor.control and not self.cursor.requeued:
            return streamlog.WORKER_LOST
        return ErrorInfo(503, "server_error", "no_worker_available",
                         "No worker started this request in time.", True, 5.0)

    # -- attaching to the worker -------------------------------------------------

    async def _attach_now(self) -> None:
        """Attach to the worker named by the (latest) Head, at once: a stream
        in its grace must learn of the reader before the grace runs out."""
        self._attached_to = self.cursor.control
        if self.cursor.ended:
            return
        try:
            await self._log.nc.publish(self._attached_to,
                                       Attach(self.request_id, self.reader_id).encode())
        except Exception as exc:
            log.debug("attach for %s failed: %s", self.request_id, exc)

    async def _keep_attached(self) -> None:
        interval = self._log.config.resume.attach_interval
        while True:
            await asyncio.sleep(interval)
            if self._attached_to and not self.cursor.ended:
                try:
                    await self._log.nc.publish(self._attached_to,
                                               Attach(self.request_id, self.reader_id).encode())
                except Exception as exc:  # broker down: the worker's lease covers a gap
                    log.debug("attach for %s failed: %s", self.request_id, exc)
