"""The WebSocket frame protocol of ``GET /v1/ws`` (sans-I/O; docs/websocket.md).

Bytes in, typed events out; nothing here imports asyncio, aiohttp or nats.

* :func:`parse_client_frame`: one client text frame into a client event or an
  :class:`Invalid` carrying the error frame to answer; a bad frame never raises.
* :class:`Connection`: one socket's state machine (enum plus transition table)
  and its live generation ids: auth first, unique ids, ``max_concurrent``.
* :class:`ChunkFramer` splices the worker's chunk bytes into a ``chunk`` frame
  by slicing: the chunk's JSON is never parsed, as on the SSE path.
* :func:`encode_text_frame`: RFC 6455 server framing, so a batch of frames is
  one transport write.
* :class:`Keepalive`: when to ping and when a silent peer is gone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Any

from tidegate.errors import ApiError, invalid_request
from tidegate.wire.protocol import Api

# The longest client id accepted: ids are echoed in every frame of their
# generation, so an unbounded one would multiply into every chunk.
MAX_ID_LENGTH = 128


class CloseCode(IntEnum):
    """Close codes the edge sends (RFC 6455 section 7.4; 4xxx are ours)."""

    NORMAL = 1000
    GOING_AWAY = 1001
    POLICY_VIOLATION = 1008
    MESSAGE_TOO_BIG = 1009
    INTERNAL_ERROR = 1011  # also: the peer stopped answering pings (as python-websockets)
    SERVICE_RESTART = 1012  # edge draining: reconnect, to another edge
    AUTH_FAILED = 4401  # missing or bad key (mirrors HTTP 401)
    AUTH_TIMEOUT = 4408  # no auth message within ws.auth_timeout (mirrors HTTP 408)


# --------------------------------------------------------------------------
# Client events
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Auth:
    key: str


@dataclass(frozen=True, slots=True)
class StartRequest:
    """``{"type": "request"}``: one streamed generation. ``body`` has
    ``stream`` forced to true (the socket only streams). ``resumable`` and
    ``resume_grace`` are the frame's own opt-in (docs/resume.md), None when
    the frame does not say (the tenant's and model's settings then decide)."""

    id: str
    api: Api
    body: dict[str, Any]
    resumable: bool | None = None
    resume_grace: float | None = None


@dataclass(frozen=True, slots=True)
class CancelRequest:
    id: str


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    id: str
    request_id: str
    after: int


@dataclass(frozen=True, slots=True)
class Ping:
    """Application-level ping from the client (answered with ``pong``)."""


@dataclass(frozen=True, slots=True)
class Pong:
    """Application-level answer to the edge's ``{"type": "ping"}``."""


@dataclass(frozen=True, slots=True)
class Invalid:
    """A frame the edge refuses: answer ``error`` (with ``id`` when the frame
    named a usable one) and keep the socket."""

    error: ApiError
    id: str | None = None


ClientEvent = Auth | StartRequest | CancelRequest | ResumeRequest | Ping | Pong | Invalid


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _frame_error(message: str, code: str, param: str | None = None) -> ApiError:
    return invalid_request(message, code=code, param=param)


def _stdlib_loads(data: bytes | str) -> Any:
    try:
        return json.loads(data, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _frame_error(f"The frame is not valid JSON: {exc}.", "invalid_json") from None


def parse_client_frame(data: bytes | str | None, paths: Mapping[str, Api], *,
                       binary: bool = False,
                       loads: Callable[[bytes | str], Any] = _stdlib_loads) -> ClientEvent:
    """One client frame -> its event. Never raises. ``paths`` are the
    request paths a ``request`` frame may name (``tidegate.apis.WEBSOCKET_PATHS``).

    ``loads`` parses the JSON and raises :class:`ApiError` for bad input; the
    edge passes its strict, depth-bounded body parser (``tidegate.validation.jsonbody``), so
    a request frame's body is held to exactly the rules of an HTTP body."""
    if binary or data is None:
        return Invalid(_frame_error("Binary frames are not part of this protocol; send JSON "
                                    "text frames.", "binary_frame"))
    try:
        frame = loads(data)
    except ApiError as exc:
        return Invalid(exc)
    if not isinstance(frame, dict):
        return Invalid(_frame_error("A frame must be a JSON object with a 'type'.",
                                    "invalid_frame"))
    kind = frame.get("type")
    raw_id = frame.get("id")
    # An id good enough to echo back, so the client can match the error.
    echo = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_LENGTH else None
    if not isinstance(kind, str):
        return Invalid(_frame_error("The frame has no string 'type'.", "invalid_frame", "type"),
                       echo)
    if kind == "ping":
        return Ping()
    if kind == "pong":
        return Pong()
    if kind == "auth":
        key = frame.get("key")
        if not isinstance(key, str) or not key:
            return Invalid(_frame_error("The auth frame needs a string 'key'.", "invalid_frame",
                                        "key"))
        return Auth(key)
    if kind not in ("request", "cancel", "resume"):
        return Invalid(_frame_error(f"Unknown frame type {kind[:40]!r}: expected request, "
                                    "cancel, resume, ping, pong or auth.", "unknown_type",
                                    "type"), echo)
    if echo is None:
        return Invalid(_frame_error(f"A {kind} frame needs an 'id': a non-empty string of at "
                                    f"most {MAX_ID_LENGTH} characters.", "invalid_id", "id"))
    if kind == "cancel":
        return CancelRequest(echo)
    if kind == "resume":
        return _resume(frame, echo)
    path = frame.get("path")
    api = paths.get(path) if isinstance(path, str) else None
    if api is None:
        return Invalid(_frame_error(f"Unknown 'path': expected one of {', '.join(paths)}.",
                                    "unknown_path", "path"), echo)
    body = frame.get("body")
    if not isinstance(body, dict):
        return Invalid(_frame_error("The request frame needs a 'body' object (the OpenAI "
                                    "request body).", "invalid_body", "body"), echo)
    resumable = frame.get("resumable")
    if resumable is not None and not isinstance(resumable, bool):
        return Invalid(_frame_error("'resumable' must be true or false.", "invalid_frame",
                                    "resumable"), echo)
    grace = frame.get("resume_grace")
    if grace is not None and (isinstance(grace, bool) or not isinstance(grace, int | float)
                              or grace < 0):
        return Invalid(_frame_error("'resume_grace' must be a non-negative number of seconds.",
                                    "invalid_frame", "resume_grace"), echo)
    body["stream"] = True  # implied: a socket only streams
    return StartRequest(echo, api, body, resumable,
                        None if grace is None else float(grace))


def _resume(frame: dict[str, Any], id: str) -> ClientEvent:
    request_id = frame.get("request_id")
    if not isinstance(request_id, str) or not request_id:
        return Invalid(_frame_error("A resume frame needs 'request_id' (the x-request-id of "
                                    "the stream).", "invalid_frame", "request_id"), id)
    after = frame.get("after", 0)
    if isinstance(after, bool) or not isinstance(after, int) or after < 0:
        return Invalid(_frame_error("'after' must be a non-negative integer (the last seq "
                                    "received).", "invalid_frame", "after"), id)
    return ResumeRequest(id, request_id, after)


# --------------------------------------------------------------------------
# Socket state
# --------------------------------------------------------------------------


class SocketState(Enum):
    AUTHENTICATING = "authenticating"  # upgraded without a Bearer header
    OPEN = "open"
    DRAINING = "draining"  # edge shutting down: no new generations
    CLOSED = "closed"


_TRANSITIONS: dict[SocketState, frozenset[SocketState]] = {
    SocketState.AUTHENTICATING: frozenset({SocketState.OPEN, SocketState.DRAINING,
                                           SocketState.CLOSED}),
    SocketState.OPEN: frozenset({SocketState.DRAINING, SocketState.CLOSED}),
    SocketState.DRAINING: frozenset({SocketState.CLOSED}),
    SocketState.CLOSED: frozenset(),
}


class Connection:
    """One socket's protocol state and live generation ids (sans-I/O).

    :meth:`receive` applies the socket-level rules to a parsed client event
    and returns what the adapter must act on: the same event, or an
    :class:`Invalid` to answer instead. Invariant: ``len(active) <=
    max_concurrent``; an id is in ``active`` from its accepted ``request`` /
    ``resume`` until :meth:`finish`, and is unique among them.
    """

    __slots__ = ("active", "max_concurrent", "state")

    def __init__(self, max_concurrent: int, *, authenticated: bool) -> None:
        self.max_concurrent = max_concurrent
        self.state = SocketState.OPEN if authenticated else SocketState.AUTHENTICATING
        self.active: set[str] = set()

    def _to(self, state: SocketState) -> None:
        if state is not self.state and state not in _TRANSITIONS[self.state]:
            raise ValueError(f"socket cannot go from {self.state.value} to {state.value}")
        self.state = state

    def authenticated(self) -> None:
        self._to(SocketState.OPEN)

    def drain(self) -> None:
        if self.state is not SocketState.CLOSED:
            self._to(SocketState.DRAINING)

    def closed(self) -> None:
        self._to(SocketState.CLOSED)

    def receive(self, event: ClientEvent) -> ClientEvent:
        state = self.state
        if state is SocketState.AUTHENTICATING:
            # Only Auth (or junk, answered as such) before the key: a request
            # frame here is refused without looking further.
            if isinstance(event, Auth | Invalid):
                return event
            return Invalid(ApiError(401, "Authenticate first: send {\"type\": \"auth\", "
                                         "\"key\": \"sk-...\"} as the first frame.",
                                    type="authentication_error", code="missing_api_key"))
        if isinstance(event, Auth):
            return Invalid(_frame_error("This socket is already authenticated.",
                                        "already_authenticated"))
        if isinstance(event, StartRequest | ResumeRequest):
            if state is not SocketState.OPEN:
                return Invalid(ApiError(503, "This edge is shutting down; open a new socket "
                                             "(to another edge) and retry.",
                                        type="service_unavailable", code="edge_draining",
                                        retryable=True, retry_after=1), event.id)
            if event.id in self.active:
                return Invalid(_frame_error(f"The id {event.id!r} is already in use on this "
                                            "socket.", "duplicate_id", "id"), event.id)
            if len(self.active) >= self.max_concurrent:
                return Invalid(ApiError(429, f"At most {self.max_concurrent} generations may "
                                             "run at once on one socket.",
                                        type="rate_limit_error", code="too_many_concurrent",
                                        retryable=True, retry_after=1), event.id)
            self.active.add(event.id)
            return event
        if isinstance(event, CancelRequest) and event.id not in self.active:
            return Invalid(ApiError(404, f"No generation {event.id!r} is running on this "
                                         "socket.", type="not_found_error", code="unknown_id",
                                    param="id"), event.id)
        return event

    def finish(self, id: str) -> None:
        """The generation ``id`` ended (done, error or cancelled); the id is free again."""
        self.active.discard(id)


# --------------------------------------------------------------------------
# Server frames
# --------------------------------------------------------------------------


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def accepted(id: str, request_id: str, ratelimit: dict[str, str] | None = None,
             *, resumable: bool = False) -> bytes:
    frame: dict[str, Any] = {"type": "accepted", "id": id, "request_id": request_id}
    if ratelimit:
        frame["ratelimit"] = ratelimit
    if resumable:
        frame["resumable"] = True
    return _dumps(frame)


def queued(id: str, position: int) -> bytes:
    return _dumps({"type": "queued", "id": id, "position": position})


def done(id: str, prompt_tokens: int, completion_tokens: int, finish_reason: str) -> bytes:
    return _dumps({"type": "done", "id": id, "usage": {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens}, "finish_reason": finish_reason})


def error(error: ApiError, id: str | None = None) -> bytes:
    """The ``error`` frame; no ``id`` when it is about the socket itself."""
    body = error.payload()["error"]
    if error.retryable:
        body["retryable"] = True
    if error.retry_after > 0:
        body["retry_after"] = error.retry_after
    frame: dict[str, Any] = {"type": "error"}
    if id is not None:
        frame["id"] = id
    frame["error"] = body
    return _dumps(frame)


def cancelled(id: str) -> bytes:
    return _dumps({"type": "cancelled", "id": id})


def reconnect(id: str, request_id: str, after: int) -> bytes:
    """Edge draining: this resumable generation goes on without this socket;
    resume it on a new one (``resume`` with these ``request_id`` and ``after``)."""
    return _dumps({"type": "reconnect", "id": id, "request_id": request_id, "after": after})


PING = b'{"type":"ping"}'
PONG = b'{"type":"pong"}'


class ChunkFramer:
    """Splices one generation's chunk bytes into ``chunk`` frames.

    Worker chunk bytes are whole SSE events (``data: <json>\\n\\n``, one or
    more, coalesced). Each event becomes one frame
    ``{"type":"chunk","id":<id>,"seq":N,"data":<json>}`` whose ``data`` is the
    event's bytes after ``data:``, untouched. ``seq`` counts this
    generation's events, 1, 2, 3, ..., exactly as a resumable stream's event
    ids do (``tidegate.wire.streamlog.EventIds``: every non-empty piece
    between blank lines counts), so it is what ``resume``'s ``after`` refers
    to. An event without data (none is expected from a worker) uses its
    number but makes no frame.
    """

    __slots__ = ("_prefix", "seq")

    def __init__(self, id: str, seq: int = 0) -> None:
        self._prefix = b'{"type":"chunk","id":' + _dumps(id) + b',"seq":'
        self.seq = seq

    def frames(self, sse: bytes) -> list[bytes]:
        """The frame payloads for these SSE bytes (maybe none)."""
        out: list[bytes] = []
        prefix = self._prefix
        for event in sse.split(b"\n\n"):
            if not event:
                continue
            self.seq += 1
            data = _event_data(event)
            if data is not None:
                out.append(b"%b%d,\"data\":%b}" % (prefix, self.seq, data))
        return out


def _event_data(event: bytes) -> bytes | None:
    """The data of one SSE event (no trailing blank line), or None for an
    event that carries none (a comment, the empty tail of a split, [DONE])."""
    if event.startswith(b"data:") and event.find(b"\n") < 0:  # the usual: one data line
        data = event[6:] if event.startswith(b"data: ") else event[5:]
    else:
        lines = [line[6:] if line.startswith(b"data: ") else line[5:]
                 for line in event.split(b"\n") if line.startswith(b"data:")]
        if not lines:
            return None
        data = b"\n".join(lines)  # SSE joins a multi-line event's data with newlines
    if not data.strip() or data == b"[DONE]":
        return None
    return data


_HEADER1 = struct.Struct("!BB").pack
_HEADER2 = struct.Struct("!BBH").pack
_HEADER3 = struct.Struct("!BBQ").pack


def encode_text_frame(payload: bytes) -> bytes:
    """One unmasked, final TEXT frame (RFC 6455 5.2), as a server sends it."""
    n = len(payload)
    if n < 126:
        return _HEADER1(0x81, n) + payload
    if n < 65536:
        return _HEADER2(0x81, 126, n) + payload
    return _HEADER3(0x81, 127, n) + payload


PING_FRAME = b"\x89\x00"  # a protocol ping, no payload


def close_frame(code: int, reason: bytes = b"") -> bytes:
    """A CLOSE frame; ``reason`` is cut to the 123 bytes a control frame allows."""
    payload = code.to_bytes(2, "big") + reason[:123]
    return _HEADER1(0x88, len(payload)) + payload


# --------------------------------------------------------------------------
# Liveness
# --------------------------------------------------------------------------


class KeepaliveAction(Enum):
    NONE = "none"
    PING = "ping"
    EVICT = "evict"


class Keepalive:
    """When to ping a socket and when to give up on it (sans-I/O).

    Invariants: no ping while traffic flows in either direction within
    ``idle_before_ping``; at most one ping outstanding; a ping unanswered
    (by a pong or any frame from the peer) within ``pong_timeout`` is one
    miss; ``max_missed`` misses in a row evict. Traffic the edge *sends*
    postpones pings but does not clear misses: only the peer speaking proves
    it is there.
    """

    __slots__ = ("idle_before_ping", "last_ping", "last_traffic", "max_missed", "missed",
                 "outstanding", "ping_interval", "pong_timeout")

    def __init__(self, *, idle_before_ping: float, ping_interval: float, pong_timeout: float,
                 max_missed: int, now: float) -> None:
        self.idle_before_ping = idle_before_ping
        self.ping_interval = ping_interval
        self.pong_timeout = pong_timeout
        self.max_missed = max_missed
        self.last_traffic = now
        self.last_ping = -1e18
        self.outstanding = False
        self.missed = 0

    def sent(self, now: float) -> None:
        """The edge sent a data frame."""
        self.last_traffic = now

    def received(self, now: float) -> None:
        """Any frame from the peer, pongs included."""
        self.last_traffic = now
        self.outstanding = False
        self.missed = 0

    def poll(self, now: float) -> KeepaliveAction:
        """What to do now; call at least every :meth:`next_check` seconds."""
        if self.outstanding:
            if now - self.last_ping < self.pong_timeout:
                return KeepaliveAction.NONE
            self.outstanding = False
            self.missed += 1
            if self.missed >= self.max_missed:
                return KeepaliveAction.EVICT
        if (now - self.last_traffic >= self.idle_before_ping
                and now - self.last_ping >= self.ping_interval):
            self.outstanding = True
            self.last_ping = now
            return KeepaliveAction.PING
        return KeepaliveAction.NONE

    def next_check(self, now: float) -> float:
        """Seconds until :meth:`poll` may have something new to say."""
        if self.outstanding:
            return max(0.0, self.last_ping + self.pong_timeout - now)
        due = max(self.last_traffic + self.idle_before_ping, self.last_ping + self.ping_interval)
        return max(0.0, due - now)
