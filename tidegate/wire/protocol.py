"""Wire envelopes: every message tidegate puts on NATS, with one encode/decode each.

Sans-I/O: bytes in, typed messages out; nothing here imports asyncio or nats.

* :class:`Request` travels once per request (edge -> ``<P>_REQUESTS`` ->
  dispatcher -> ``<P>_JOBS`` -> worker): a msgpack map with a ``v`` field, so
  fields can be added without breaking older readers.
* Session messages (:class:`Status`, :class:`Head`, :class:`Chunk`, ...,
  the edge's :class:`Ack` / :class:`Cancel`) are msgpack arrays
  ``[v, kind, seq, ...]``: no key strings on the per-chunk path.

``seq``: the worker numbers its messages 1, 2, 3, ... per request (``Head`` is
1), dispatcher ``Status`` messages carry 0, and an ``Ack`` carries the highest
seq written to the client. Docs: docs/architecture.md#session-protocol.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import msgpack

from tidegate.errors import ProtocolError

VERSION = 1

# NATS header on a job whose admission reserved quota: its usage record must be
# reconciled. Without it the reconciler skips Redis for that request.
RESERVED_HEADER = "Tg-Reserved"


class Kind(IntEnum):
    STATUS = 0
    HEAD = 1
    CHUNK = 2
    HEARTBEAT = 3
    DONE = 4
    ERROR = 5
    ACK = 6
    CANCEL = 7
    MUX = 8  # several sessions' messages in one NATS message (tidegate.mux)
    RETRANSMIT = 9  # edge -> worker: send again from this seq (a lost message)
    ATTACH = 10  # edge -> worker: a reader of a resumable stream is here
    DETACH = 11  # edge -> worker: that reader left
    LOG_OPEN = 12  # first entry of a resumable stream's log (tidegate.wire.streamlog)
    CONTINUE = 13  # edge -> worker: go ahead, continuing from the delivered text
    LOG_HANDBACK = 14  # edge -> a stream log: its worker died, the job was handed on


_CHUNK = int(Kind.CHUNK)  # a plain int packs faster than the enum member (per chunk)


class Api(IntEnum):
    """Which endpoint (OpenAI's, or Anthropic's Messages) a request came in on
    (decides the chunk format).

    Values are on the wire (``Request.api``): append, never renumber."""

    CHAT = 0
    COMPLETIONS = 1
    RESPONSES = 2  # /v1/responses: typed SSE events (``event:`` + ``data:``), no [DONE]
    EMBEDDINGS = 3  # /v1/embeddings: never streamed, input tokens only
    MESSAGES = 4  # Anthropic's /v1/messages: typed SSE events, no [DONE] (docs/anthropic.md)


class Admission(IntEnum):
    ADMITTED = 0
    QUEUED = 1
    REJECTED = 2


# --------------------------------------------------------------------------
# Request (map envelope)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One client request, as the edge publishes it and the worker runs it.

    ``body`` is the client's JSON body after validation (already parsed by the
    edge; the worker re-serialises it once for the backend call).
    ``deadline_ms`` is the wall-clock time (ms since epoch) after which nobody
    waits for the answer any more: the dispatcher and workers drop the request
    instead of running it for a client that is gone.
    ``window_bytes`` / ``window_msgs`` are the flow-control window the edge
    grants the worker for this session.
    """

    id: str
    reply: str
    model: str
    api: Api
    stream: bool
    body: dict[str, Any]
    created_ms: int
    deadline_ms: int
    window_bytes: int
    window_msgs: int
    include_usage: bool = False
    tenant: str = "default"
    user: str = ""
    key_id: str = ""
    klass: str = "interactive"
    edge: str = ""
    # Where the edge also accepts its sessions' messages multiplexed (several
    # requests' in one NATS message, see tidegate.mux); "" = only on ``reply``.
    # A capability the edge advertises per request, so edges and workers of
    # different versions mix during a rolling upgrade.
    mux: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # Resumable stream (docs/resume.md): the worker also writes its messages to
    # the stream log, and a reader leaving starts ``grace`` seconds of
    # generation without one instead of a cancel.
    resumable: bool = False
    grace: float = 0.0
    # A body too large for a NATS message crosses by claim check: ``body`` is
    # then empty in the message, and this names the object in <P>_BODIES
    # that holds it (tidegate.broker.bodies); "" = the body is inline.
    claim: str = ""

    def encode(self) -> bytes:
        """Raises :class:`ProtocolError` if the body holds a value msgpack cannot
        carry (an integer outside the 64-bit range)."""
        try:
            return self._encode()
        except (OverflowError, ValueError, TypeError) as exc:
            raise ProtocolError(f"request cannot be encoded: {exc}") from exc

    def _encode(self) -> bytes:
        fields: dict[str, Any] = {
            "v": VERSION,
            "id": self.id,
            "reply": self.reply,
            "model": self.model,
            "api": int(self.api),
            "stream": self.stream,
            "body": self.body,
            "created_ms": self.created_ms,
            "deadline_ms": self.deadline_ms,
            "window_bytes": self.window_bytes,
            "window_msgs": self.window_msgs,
            "include_usage": self.include_usage,
            "tenant": self.tenant,
            "user": self.user,
            "key_id": self.key_id,
            "class": self.klass,
            "edge": self.edge,
            "mux": self.mux,
            "extra": self.extra,
            "resumable": self.resumable,
            "grace": self.grace,
        }
        if self.claim:  # only then: an inline body's envelope stays as it was
            fields["claim"] = self.claim
        return msgpack.packb(fields)

    @classmethod
    def decode(cls, data: bytes) -> Request:
        try:
            m = msgpack.unpackb(data)
        except Exception as exc:
            raise ProtocolError(f"request envelope is not msgpack: {exc}") from exc
        if not isinstance(m, dict):
            raise ProtocolError("request envelope is not a map")
        version = m.get("v")
        if version != VERSION:
            raise ProtocolError(f"unsupported request envelope version {version!r}")
        try:
            request = cls(
                id=_str(m, "id"),
                reply=_str(m, "reply"),
                model=_str(m, "model"),
                api=Api(m["api"]),
                stream=bool(m["stream"]),
                body=_dict(m, "body"),
                created_ms=int(m["created_ms"]),
                deadline_ms=int(m["deadline_ms"]),
                window_bytes=int(m["window_bytes"]),
                window_msgs=int(m["window_msgs"]),
                include_usage=bool(m.get("include_usage", False)),
                tenant=str(m.get("tenant", "default")),
                user=str(m.get("user", "")),
                key_id=str(m.get("key_id", "")),
                klass=str(m.get("class", "interactive")),
                edge=str(m.get("edge", "")),
                mux=str(m.get("mux", "")),
                extra=dict(m.get("extra") or {}),
                resumable=bool(m.get("resumable", False)),
                grace=float(m.get("grace", 0.0)),
                claim=str(m.get("claim", "")),
            )
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            raise ProtocolError(f"malformed request envelope: {exc!r}") from exc
        # Invariants every tier relies on; an envelope from the broker is untrusted.
        if not request.id or request.window_bytes < 1 or request.window_msgs < 1:
            raise ProtocolError("malformed request envelope: empty id or a window below 1")
        return request


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """What one finished request cost, published to ``<P>_USAGE``.

    Workers publish one per job they ran (``outcome`` done / error /
    cancelled), with the actual tokens, including the partial output of a
    cancelled stream, and one with ``outcome = "dropped"`` and no tokens for a
    job they did not run (client gone, or a redelivered job its edge did not
    confirm); dispatchers reconcile the quota reservation with it. A job whose
    worker died is settled by its redelivery's record or, failing that, by the
    concurrency lease expiring.
    Timings are milliseconds; ``queue_wait_ms`` runs from the edge accepting
    the request to the worker picking it up.
    """

    id: str
    model: str
    outcome: str
    tenant: str = "default"
    user: str = ""
    key_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    queue_wait_ms: float = 0.0
    ttft_ms: float = 0.0
    duration_ms: float = 0.0
    attempt: int = 1
    # Whether admission reserved quota for the request (the dispatcher marks
    # the job with the RESERVED_HEADER). Unknown means yes: settling a
    # reservation that does not exist is harmless, skipping one is not.
    reserved: bool = True
    # Of prompt_tokens, those served from the backend's prefix cache.
    cached_tokens: int = 0
    # What the request cost, in nano-units (10^-9) of ``currency``, at the
    # model's price when the worker picked the job up; "" = no price set.
    cost_nanos: int = 0
    currency: str = ""
    # Prompt tokens a continuation cost beyond the request's own: the
    # operator's, in neither prompt_tokens, the quota nor cost_nanos.
    operator_prompt_tokens: int = 0

    def encode(self) -> bytes:
        fields = {f: getattr(self, f) for f in self.__slots__}
        return msgpack.packb({"v": VERSION, **fields})

    @classmethod
    def decode(cls, data: bytes) -> UsageRecord:
        try:
            m = msgpack.unpackb(data)
            if not isinstance(m, dict) or m.get("v") != VERSION:
                raise ProtocolError("usage record is not a version-1 map")
            known = {f: m[f] for f in cls.__slots__ if f in m}
            for name in ("cached_tokens", "cost_nanos", "operator_prompt_tokens"):
                value = known.get(name, 0)
                if isinstance(value, bool) or not isinstance(value, int) or not (
                        0 <= value < 1 << 62):
                    raise ProtocolError(f"usage record: {name} must be an integer >= 0")
            if not isinstance(known.get("currency", ""), str):
                raise ProtocolError("usage record: currency must be a string")
            return cls(**known)
        except ProtocolError:
            raise
        except Exception as exc:
            raise ProtocolError(f"malformed usage record: {exc!r}") from exc


def _str(m: dict[str, Any], key: str) -> str:
    value = m[key]
    if not isinstance(value, str) or not value:
        raise ValueError(f"{key} must be a non-empty string")
    return value


def _dict(m: dict[str, Any], key: str) -> dict[str, Any]:
    value = m[key]
    if not isinstance(value, dict):
        raise ValueError(f"{key} must be a map")
    return value


# --------------------------------------------------------------------------
# Session messages (array envelopes)
# --------------------------------------------------------------------------


class ErrorInfo(NamedTuple):
    """An OpenAI-style error, as it crosses the broker.

    ``status`` is the HTTP status the edge answers with when no byte has been
    written to the client yet; after that the error becomes a final SSE event.
    """

    status: int
    type: str
    code: str
    message: str
    retryable: bool = False
    retry_after: float = 0.0


class Status(NamedTuple):
    """Dispatcher -> edge: what admission decided, with ``seq = 0``. A worker
    handing a preempted batch line back sends ``QUEUED`` with its last seq.

    ``headers`` are response headers the edge adds (OpenAI's
    ``x-ratelimit-*`` family), on admission as on rejection.
    """

    admission: Admission
    position: int = 0
    error: ErrorInfo | None = None
    seq: int = 0
    headers: dict[str, str] | None = None

    def encode(self) -> bytes:
        err = list(self.error) if self.error is not None else None
        return _pack([VERSION, Kind.STATUS, self.seq, int(self.admission), self.position, err,
                      self.headers])


class Head(NamedTuple):
    """Worker -> edge, ``seq = flow.first_seq(attempt)``: the backend accepted
    the request.

    ``control`` is the worker's subject for :class:`Ack` and :class:`Cancel`.
    ``job_seq`` is the job's JetStream stream sequence (proof it crossed the broker).
    ``attempt`` is JetStream's delivery count: above 1 the job was redelivered
    after a worker died, and the worker waits for the edge's go-ahead (an
    ``Ack`` with ``seq = 0``) before it calls the backend, so output that
    already reached the client is never generated a second time.
    ``ack`` is the job message's JetStream ack subject: an edge that finds the
    worker dead (tidegate.broker.liveness) sends ``-NAK`` there, so JetStream hands the
    job to another worker at once instead of after ``worker.ack_wait``.
    """

    seq: int
    control: str
    job_seq: int = 0
    attempt: int = 1
    ack: str = ""

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.HEAD, self.seq, self.control, self.job_seq, self.attempt,
                      self.ack])


class Chunk(NamedTuple):
    """Worker -> edge: bytes ready to write to the client socket as they are.

    For a streaming request ``data`` holds one or more complete SSE events
    (``data: {...}\\n\\n``), coalesced; for a non-streaming one it is a slice of
    the JSON body. The edge never parses it.
    """

    seq: int
    data: bytes

    def encode(self) -> bytes:
        return encode_chunk(self.seq, self.data)


def encode_chunk(seq: int, data: bytes) -> bytes:
    """:class:`Chunk` encoding without building the tuple first: the worker
    sends one per backend read, so it skips that allocation."""
    return _pack([VERSION, _CHUNK, seq, data])


class Heartbeat(NamedTuple):
    """Worker -> edge while the backend is silent: the worker is alive."""

    seq: int

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.HEARTBEAT, self.seq])


_MONEY = re.compile(r"[0-9]{1,18}(\.[0-9]{1,9})?")  # a plain decimal amount


class Done(NamedTuple):
    """Worker -> edge: the response is complete. ``cost``: what it cost, a
    decimal string in the currency (the edge's ``x-tidegate-cost``); "" when
    the model has no price (and from workers that predate prices)."""

    seq: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    cost: str = ""

    def encode(self) -> bytes:
        return _pack(
            [
                VERSION,
                Kind.DONE,
                self.seq,
                self.prompt_tokens,
                self.completion_tokens,
                self.finish_reason,
                self.cost,
            ]
        )

    def cost_headers(self, currency: str) -> dict[str, str]:
        """``x-tidegate-cost`` / ``x-tidegate-currency`` (docs/spend.md); none
        without a cost or with one that is not a plain amount (it comes from a
        worker and goes into a header)."""
        if not self.cost or not _MONEY.fullmatch(self.cost):
            return {}
        return {"x-tidegate-cost": self.cost, "x-tidegate-currency": currency}


class Error(NamedTuple):
    """Worker (or dispatcher) -> edge: the request failed; this is the end."""

    seq: int
    error: ErrorInfo

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.ERROR, self.seq, list(self.error)])


class Ack(NamedTuple):
    """Edge -> worker control subject: every worker ``seq`` up to this one is
    written to the client socket and drained (cumulative)."""

    request_id: str
    seq: int

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.ACK, 0, self.request_id, self.seq])


class Continue(NamedTuple):
    """Edge -> worker control subject: the go-ahead of a redelivered job whose
    first worker died after output reached the client (docs/resume.md,
    "Continuation"). ``text`` is what the client received, ``tokens`` how many
    content events carried it: the worker asks the backend to continue the
    text, with the token limit reduced by ``tokens``, and drops what would
    repeat the stream's opening (the role chunk).

    A Responses stream's seam needs more (workers/continuation.py,
    ``ContinuedResponses``): ``events``, the sequence_number its next event
    takes; ``response_id`` and ``item_id``, the ids the client saw (the new
    backend names its own); ``opened``, how many of the opening events
    (created, in_progress, output_item.added, content_part.added) it got.
    Encoded after the first three, so an older decoder reads what it knows."""

    request_id: str
    text: str
    tokens: int
    events: int = 0
    response_id: str = ""
    item_id: str = ""
    opened: int = 0

    def encode(self) -> bytes:
        head = [VERSION, Kind.CONTINUE, 0, self.request_id, self.text, self.tokens]
        if self.events or self.response_id or self.item_id or self.opened:
            head += [self.events, self.response_id, self.item_id, self.opened]
        return _pack(head)


# Cancel.reason for a copy of a job that another copy owns the stream of:
# JetStream delivers a job again when its in-progress acks did not arrive for
# ``worker.ack_wait`` (a worker stopped that long, or a NATS node's death and
# the JetStream leader change behind it) although its worker lives; the edge
# tells the second copy so (edge.relay). And a worker the edge took for dead
# and handed the job on from is told so, should it be alive after all
# (edge.continuation). The copy ends without a trace: nothing to the edge, no
# usage record (the owner's counts the whole response), no ack (the message
# stays the owner's: its death still redelivers it).
DUPLICATE_DELIVERY = "duplicate_delivery"


class Cancel(NamedTuple):
    """Edge -> worker / dispatcher: the client is gone; stop the work."""

    request_id: str
    reason: str

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.CANCEL, 0, self.request_id, self.reason])


class Retransmit(NamedTuple):
    """Edge -> worker: a message was lost in transit (the edge saw a gap);
    send every message from ``seq`` on again. Idempotent: a repeat, or one for
    messages already resent, resends again; the edge drops what it already has."""

    request_id: str
    seq: int

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.RETRANSMIT, 0, self.request_id, self.seq])


class Attach(NamedTuple):
    """Edge -> worker: ``reader`` (a random id per reading connection) reads
    this resumable stream. Sent again every ``resume.attach_interval``: a
    reader not heard from for three of them is gone (its edge died)."""

    request_id: str
    reader: str

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.ATTACH, 0, self.request_id, self.reader])


class Detach(NamedTuple):
    """Edge -> worker: ``reader`` left (its client disconnected). For the
    original connection ``reader`` is ``""``. Once no reader is left the
    worker generates on for the request's grace, then cancels."""

    request_id: str
    reader: str

    def encode(self) -> bytes:
        return _pack([VERSION, Kind.DETACH, 0, self.request_id, self.reader])


SessionMessage = Status | Head | Chunk | Heartbeat | Done | Error
ControlMessage = Ack | Cancel | Retransmit | Attach | Detach | Continue

_pack = msgpack.Packer(use_bin_type=True).pack
_unpackb = msgpack.unpackb


def _error_info(raw: Any) -> ErrorInfo:
    status, type_, code, message, retryable, retry_after = raw
    return ErrorInfo(int(status), str(type_), str(code), str(message), bool(retryable),
                     float(retry_after))


def decode_session(data: bytes) -> SessionMessage:
    """Decode a message received on an edge's ``out`` subject."""
    try:
        t = _unpackb(data)
        if t[0] != VERSION:
            raise ProtocolError(f"unsupported session envelope version {t[0]!r}")
        kind = t[1]
        # Chunk first: it is by far the most frequent message.
        if kind == Kind.CHUNK:
            return Chunk(t[2], t[3])
        if kind == Kind.HEARTBEAT:
            return Heartbeat(t[2])
        if kind == Kind.HEAD:
            return Head(t[2], t[3], t[4], t[5] if len(t) > 5 else 1, t[6] if len(t) > 6 else "")
        if kind == Kind.DONE:
            return Done(t[2], t[3], t[4], t[5], t[6] if len(t) > 6 and isinstance(t[6], str)
                        else "")
        if kind == Kind.ERROR:
            return Error(t[2], _error_info(t[3]))
        if kind == Kind.STATUS:
            err = _error_info(t[5]) if t[5] is not None else None
            headers = t[6] if len(t) > 6 and t[6] else None
            return Status(Admission(t[3]), t[4], err, t[2], headers)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed session message: {exc!r}") from exc
    raise ProtocolError(f"unexpected message kind {kind!r} on a session subject")


def decode_control(data: bytes) -> ControlMessage:
    """Decode a message received on a worker's control subject."""
    try:
        t = _unpackb(data)
        if t[0] != VERSION:
            raise ProtocolError(f"unsupported control envelope version {t[0]!r}")
        kind = t[1]
        if kind == Kind.ACK:
            return Ack(str(t[3]), int(t[4]))
        if kind == Kind.CANCEL:
            return Cancel(str(t[3]), str(t[4]))
        if kind == Kind.RETRANSMIT:
            return Retransmit(str(t[3]), int(t[4]))
        if kind == Kind.ATTACH:
            return Attach(str(t[3]), str(t[4]))
        if kind == Kind.DETACH:
            return Detach(str(t[3]), str(t[4]))
        if kind == Kind.CONTINUE:
            seam = (int(t[6]), str(t[7]), str(t[8]), int(t[9])) if len(t) > 9 else ()
            return Continue(str(t[3]), str(t[4]), int(t[5]), *seam)
    except ProtocolError:
        raise
    except Exception as exc:
        raise ProtocolError(f"malformed control message: {exc!r}") from exc
    raise ProtocolError(f"unexpected message kind {kind!r} on a control subject")
