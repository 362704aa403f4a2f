"""The stream log of resumable streams: names, entries, event ids (sans-I/O).

A resumable stream is written, as it is produced, to ``<P>_STREAMLOG`` under
``<p>.log.<request_id>``; any edge replays it and follows its tail
(``edge.logreader``). Entries: first a :class:`LogOpen` (tenant and request
shape, written by the accepting edge before it publishes the request; a log
without it is not served), then the worker's session messages, byte for byte,
one or a mux batch per log message.

Event ids count *events*, not messages (a chunk may carry several), from 1.
The live relay and every log reader number them with the same :class:`EventIds`
over the same chunks, so the seam between one connection and the next replay
is exact. Docs: docs/resume.md#the-log.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import msgpack

from tidegate.errors import ProtocolError
from tidegate.wire.protocol import (
    VERSION,
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Kind,
    SessionMessage,
    decode_session,
)
from tidegate.wire.subjects import Subjects

_pack = msgpack.Packer(use_bin_type=True).pack


def stream_name(subjects: Subjects) -> str:
    return f"{subjects.prefix.upper()}_STREAMLOG"


def wildcard(subjects: Subjects) -> str:
    return f"{subjects.prefix}.log.>"


def subject(subjects: Subjects, request_id: str) -> str:
    """The log subject of one request (request ids are hex: a valid token)."""
    return f"{subjects.prefix}.log.{request_id}"


def edge_cancel_subject(subjects: Subjects) -> str:
    """Every edge listens here for ``POST /v1/streams/{id}/cancel`` made on
    another edge; the edge holding the request's connection answers."""
    return f"{subjects.prefix}.streams.cancel"


class LogOpen(NamedTuple):
    """The edge's first entry: whose stream it is and what it looks like."""

    tenant: str
    stream: bool  # SSE events (True) or a JSON body in slices (False)
    api: int
    created_ms: int
    grace: float

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.LOG_OPEN, 0, self.tenant, self.stream, self.api,
                      self.created_ms, self.grace])


class LogHandBack(NamedTuple):
    """An edge's entry: the worker at ``control`` was found dead (the edge's
    liveness probe) and its job handed back to JetStream to be continued
    elsewhere. The next worker, reading the log, may continue at once on this
    word, which outlives the edge (an edge that dies right after the hand-back
    can no longer answer the next worker's ``Head``)."""

    control: str
    # Written by a worker that gave its slot away (workers.preemption): the
    # job waits in JetStream to be continued, however long a slot takes. An
    # edge's hand-back of a dead worker is not: its next copy may find it
    # cannot continue, and readers then end at the usual silence.
    preempted: bool = False

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.LOG_HANDBACK, 0, self.control, *([True] * self.preempted)])


LogEntry = LogOpen | LogHandBack | SessionMessage

# How many of a resumable stream's last messages its edge keeps (LiveTail).
# The worker stores its log one batch per JetStream round trip while the live
# path runs ahead (workers.resumable), so the log lags the client by a few
# messages: 64 outlast any lag but a leader election's.
TAIL_MESSAGES = 64


class LiveTail:
    """The last messages with a seq (chunks and heartbeats) that a resumable
    stream's edge relayed to its client, in order.

    The log lags the live path: a worker that dies leaves the client with
    events its log never got, and a reader that comes later (or the worker
    that continues the log) would miss them. Once the worker is found dead,
    the edge stores what the log lacks (:meth:`after`), so the log holds at
    least every event the client got. Readers skip what the log already has
    (:class:`LogCursor`: a seq below the one expected is a copy)."""

    __slots__ = ("_kept",)

    def __init__(self, size: int = TAIL_MESSAGES) -> None:
        self._kept: deque[Chunk | Heartbeat] = deque(maxlen=size)

    def add(self, message: Chunk | Heartbeat) -> None:
        self._kept.append(message)

    def __len__(self) -> int:
        return len(self._kept)

    def after(self, logged: int) -> list[Chunk | Heartbeat] | None:
        """The kept messages that follow seq ``logged`` (the log's last)
        without a gap: ``[]`` when the log has them all, None when the tail
        no longer holds ``logged + 1`` (it fell further behind than the
        tail is long, or it lacks this delivery's Head: a later delivery's
        seqs start 2**32 on, tidegate.wire.flow.first_seq)."""
        run: list[Chunk | Heartbeat] = []
        want = logged + 1
        for message in self._kept:
            if message.seq < want:
                continue
            if message.seq != want:
                break
            run.append(message)
            want += 1
        if not run and self._kept and self._kept[-1].seq > logged:
            return None
        return run


def last_seq(entries: list[LogEntry]) -> int:
    """The highest seq among one log message's worker messages (0: none)."""
    return max((e.seq for e in entries if not isinstance(e, (LogOpen, LogHandBack))), default=0)


def batch(request_id: str, messages: list[bytes]) -> bytes:
    """One log message of several session messages, as the worker's log
    outbox writes them (``[VERSION, Kind.MUX, request_id, message, ...]``)."""
    out: list[object] = [VERSION, Kind.MUX]
    for message in messages:
        out += (request_id, message)
    return _pack(out)


def decode_entry(data: bytes) -> list[LogEntry]:
    """The entries of one log message, in order. Raises :class:`ProtocolError`."""
    try:
        t = msgpack.unpackb(data)
    except Exception as exc:
        raise ProtocolError(f"log entry is not msgpack: {exc}") from exc
    if not isinstance(t, list) or len(t) < 2 or t[0] != VERSION:
        raise ProtocolError("log entry is not a version-1 array")
    kind = t[1]
    if kind == Kind.LOG_OPEN:
        try:
            return [LogOpen(str(t[3]), bool(t[4]), int(t[5]), int(t[6]), float(t[7]))]
        except (IndexError, TypeError, ValueError) as exc:
            raise ProtocolError(f"malformed log open entry: {exc!r}") from exc
    if kind == Kind.LOG_HANDBACK:
        if len(t) < 4 or not isinstance(t[3], str):
            raise ProtocolError("malformed log hand-back entry")
        return [LogHandBack(t[3], len(t) > 4 and t[4] is True)]
    if kind == Kind.MUX:
        if len(t) % 2:
            raise ProtocolError("malformed mux batch in the log")
        out: list[LogEntry] = []
        for message in t[3::2]:
            if type(message) is not bytes:
                raise ProtocolError("mux frame in the log is not bytes")
            out.append(decode_session(message))
        return out
    return [decode_session(data)]


def split_events(data: bytes) -> list[bytes]:
    """The SSE events of a chunk, each with its terminating blank line. A
    trailing piece without one (a backend that breaks the format) is kept as
    its own event rather than dropped."""
    pieces = data.split(b"\n\n")
    events = [p + b"\n\n" for p in pieces[:-1] if p]
    if pieces[-1]:
        events.append(pieces[-1])
    return events


class EventIds:
    """Numbers a stream's SSE events 1, 2, 3, ... (see the module docstring)."""

    __slots__ = ("last", "prefix")

    def __init__(self, prefix: bytes = b"") -> None:
        self.last = 0
        # Field lines written once, in front of the first event's ``id:``
        # (the ``retry:`` field, see :func:`retry_field`).
        self.prefix = prefix

    def frame(self, data: bytes) -> bytes:
        """``data`` (one chunk's events) with ``id: N`` in front of each event."""
        parts: list[bytes] = []
        if self.prefix:
            parts.append(self.prefix)
            self.prefix = b""
        n = self.last
        for event in split_events(data):
            n += 1
            parts.append(b"id: %d\n%b" % (n, event))
        self.last = n
        return b"".join(parts)


def retry_field(ms: int) -> bytes:
    """The SSE ``retry:`` field line, sent once at the start of a resumable
    stream, in the block of its first event (:class:`EventIds` ``prefix``).

    Not a block of its own: the openai SDK's decoder, like others, turns a
    block with a ``retry:`` field and no ``data:`` into an event with empty
    data, and then fails to parse it as JSON."""
    return b"retry: %d\n" % ms


class LogEvent(NamedTuple):
    """One event of a stream: ``id`` counts from 1. For a streaming request
    ``data`` is one complete SSE event as the backend produced it
    (``data: {...}\\n\\n``, no ``id:`` line); for a non-streaming one it is a
    slice of the JSON body (``id`` then counts slices)."""

    id: int
    data: bytes


class LogEnd(NamedTuple):
    """The stream's end: ``done`` (usage from the worker) or ``error``."""

    done: Done | None = None
    error: ErrorInfo | None = None


LogItem = LogEvent | LogEnd

WORKER_LOST = ErrorInfo(502, "server_error", "worker_lost",
                        "The worker running this request was lost mid-response.", True, 1.0)


def gap_error(expected: int, got: int) -> ErrorInfo:
    return ErrorInfo(502, "server_error", "stream_gap",
                     f"The stream log lost part of the response (expected message "
                     f"{expected}, got {got}).", True, 1.0)


class LogCursor:
    """Turns a stream's log entries, fed in order, into :class:`LogItem` s:
    the events after ``after``, then one :class:`LogEnd`.

    It applies the relay's rules to the log: sequence numbers must follow
    each other (a gap ends the stream with ``stream_gap``). A second ``Head``
    is the job redelivered after its worker died: before output it restarts
    the stream; after output it continues it (``failover = "continue"``: the
    next worker read this log, asks its backend to continue the text of its
    events, and logs its ``Head`` only once it does, workers/resumable.py),
    so its seqs start again and the event ids go on.
    """

    __slots__ = ("_after", "_expected", "_floor", "_output", "_preempted", "control", "ended",
                 "handed_back",
                 "ids", "open")

    def __init__(self, after: int = 0) -> None:
        self._after = after
        self._expected = 0  # 0: no Head yet
        # The last Head's seq (flow.first_seq): an entry below it is an
        # earlier delivery's, logged late (a fenced worker's buffer flushed at
        # the heal); skipped, Head included, never read as the text.
        self._floor = 0
        self._output = False
        self.ids = EventIds()
        self.control = ""  # the worker's control subject, from the last Head
        self.handed_back = ""  # the worker an edge last found dead (LogHandBack)
        self._preempted = False  # ... or that handed its job back itself (preempted)
        self.open: LogOpen | None = None
        self.ended = False

    def feed(self, entry: LogEntry) -> list[LogItem]:
        if self.ended:
            return []
        kind = type(entry)
        if kind is LogOpen:
            assert isinstance(entry, LogOpen)
            self.open = entry
            return []
        if kind is LogHandBack:
            assert isinstance(entry, LogHandBack)
            self.handed_back = entry.control
            self._preempted = entry.preempted
            return []
        if kind is Head:
            assert isinstance(entry, Head)
            if entry.seq < self._floor:
                return []
            self.control = entry.control
            self._floor = entry.seq
            self._expected = entry.seq + 1
            return []
        seq: int = entry.seq  # type: ignore[union-attr]
        if not self._expected:
            if kind is Error:  # ended before any worker started (an edge wrote it)
                assert isinstance(entry, Error)
                return self._end(LogEnd(error=entry.error))
            return []  # a message before any Head: not the worker's output
        if seq < self._expected:
            return []  # a duplicate (retransmitted and logged again), or stale: already had it
        if seq != self._expected:
            return self._end(LogEnd(error=gap_error(self._expected, seq)))
        self._expected = seq + 1
        if kind is Chunk:
            assert isinstance(entry, Chunk)
            self._output = True
            return self._events(entry.data)
        if kind is Heartbeat:
            return []
        if kind is Done:
            assert isinstance(entry, Done)
            return self._end(LogEnd(done=entry))
        if kind is Error:
            assert isinstance(entry, Error)
            return self._end(LogEnd(error=entry.error))
        return []

    @property
    def output(self) -> bool:
        """Whether the stream has had an event yet."""
        return self._output

    @property
    def requeued(self) -> bool:
        """The worker of the last Head gave its job back (preempted): it
        waits for its next worker, as a new request waits for its first."""
        return self._preempted and bool(self.handed_back) and self.handed_back == self.control

    @property
    def next_seq(self) -> int:
        """The seq the log's next message takes (0: no Head yet)."""
        return self._expected

    def fail(self, error: ErrorInfo) -> list[LogItem]:
        """End the stream from the reader's side (its silence limits)."""
        if self.ended:
            return []
        return self._end(LogEnd(error=error))

    def _events(self, data: bytes) -> list[LogItem]:
        ids = self.ids
        stream = self.open.stream if self.open is not None else True
        pieces = split_events(data) if stream else [data]
        out: list[LogItem] = []
        for piece in pieces:
            ids.last += 1
            if ids.last > self._after:
                out.append(LogEvent(ids.last, piece))
        return out

    def _end(self, end: LogEnd) -> list[LogItem]:
        self.ended = True
        return [end]
