"""A small HTTP/1.1 client for the worker's per-chunk path.

The body is *pushed*: the connection's ``data_received`` decodes the HTTP
framing and calls the consumer synchronously, so a chunk reaches the NATS
outbox in the callback that read it, without aiohttp's per-chunk reader,
future and task steps. It does: ``Content-Length`` requests;
``Content-Length``, chunked or close-delimited responses; keep-alive pooling
(:data:`KEEPALIVE`); TLS; one retry of a reused connection the server closed.
Not: redirects, proxies, cookies, compression, HTTP/2 (no model server needs them).

Invariants: a connection returns to the pool only after a complete body with
neither side asking to close; a response whose consumer stops early is closed;
bytes arriving while the consumer paused are kept, at most one socket read.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
from collections.abc import Callable
from typing import cast
from urllib.parse import urlsplit

__all__ = ["BodyTooLarge", "ConnectTimeout", "Http1Pool", "ProtocolViolation", "Response",
           "ServerDisconnected"]

KEEPALIVE = 4.0  # below uvicorn's 5 s default, so a reused socket is rarely one being closed
MAX_HEAD = 64 << 10  # bytes of status line plus headers


class ServerDisconnected(ConnectionError):
    """The server closed the connection before the response was complete."""


class ProtocolViolation(ConnectionError):
    """The server's bytes are not an HTTP/1.1 response this client can read."""


class ConnectTimeout(ConnectionError):
    """No connection within the pool's connect timeout."""


class BodyTooLarge(Exception):
    """A body read with :meth:`Response.read_all` went over its limit."""


DataCallback = Callable[[bytes], None]
EndCallback = Callable[[BaseException | None], None]


class Response:
    """The status, headers and body of one response.

    The body is pushed: after :meth:`start`, ``on_data`` gets the decoded body
    bytes of each socket read (never empty) and ``on_end`` is called once, with
    None after the last byte or with the exception that cut the body short.
    Both run inside the connection's ``data_received``: they must not block.
    """

    __slots__ = ("_conn", "_early", "_error", "_on_data", "_on_end", "ended", "headers",
                 "status")

    def __init__(self, conn: _Connection, status: int, headers: dict[str, str]) -> None:
        self._conn = conn
        self.status = status
        self.headers = headers  # lower-case names; repeated headers joined with ", "
        self._on_data: DataCallback | None = None
        self._on_end: EndCallback | None = None
        self._early: list[bytes] = []  # body bytes that came before start()
        self.ended = False  # the body is complete or cut short
        self._error: BaseException | None = None  # what cut it short

    def start(self, on_data: DataCallback, on_end: EndCallback) -> None:
        self._on_data, self._on_end = on_data, on_end
        early, self._early = self._early, []
        if early and not self.ended:
            # Paused when the early bytes came. Resume first: the consumer
            # may pause again while taking them, and that pause must hold
            # (resuming only re-arms reading, no bytes arrive in between).
            self._conn.resume()
        for data in early:
            on_data(data)
        if self.ended:
            on_end(self._error)

    def pause(self) -> None:
        """Stop reading the socket (TCP then pushes back on the server)."""
        if not self.ended:
            self._conn.pause()

    def resume(self) -> None:
        if not self.ended and self._on_data is not None:
            self._conn.resume()

    def abort(self) -> None:
        """Close the connection now; the server sees it at once. Idempotent.
        The consumer hears nothing more (its callbacks are dropped, which also
        keeps response and consumer from holding each other alive)."""
        self._on_data = _discard
        self._on_end = _ignore
        self._conn.abort()

    def finish(self, grace: float) -> None:
        """The consumer needs no more of the body: reuse the connection if the
        body ends within ``grace`` seconds (the usual case after an SSE
        ``[DONE]``, whose chunked terminator is in flight), else close it."""
        self._on_data = _discard
        self._on_end = _ignore
        if not self.ended:
            self._conn.resume()
            self._conn.close_after(grace)

    async def read_all(self, limit: int, *, truncate: bool = False) -> bytes:
        """The whole body. Past ``limit`` bytes the connection is closed and
        :class:`BodyTooLarge` raised, or with ``truncate`` the first ``limit``
        bytes returned."""
        parts: list[bytes] = []
        size = 0
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def on_data(data: bytes) -> None:
            nonlocal size
            size += len(data)
            if size > limit:
                if truncate:
                    parts.append(data[:len(data) - (size - limit)])
                self.abort()
                if not done.done():
                    if truncate:
                        done.set_result(None)
                    else:
                        done.set_exception(BodyTooLarge(limit))
                return
            parts.append(data)

        def on_end(exc: BaseException | None) -> None:
            if done.done():
                return
            if exc is None:
                done.set_result(None)
            else:
                done.set_exception(exc)

        self.start(on_data, on_end)
        try:
            await done
        except BaseException:
            self.abort()
            raise
        return b"".join(parts)

    # -- called by the connection ---------------------------------------------

    def _data(self, data: bytes) -> None:
        if self._on_data is None:
            self._early.append(data)
            self._conn.pause()  # hold at most this read until a consumer starts
        else:
            self._on_data(data)

    def _end(self, exc: BaseException | None) -> None:
        if self.ended:
            return
        self.ended, self._error = True, exc
        on_end = self._on_end
        if on_end is not None:
            self._on_data = self._on_end = None  # done with the consumer
            on_end(exc)


def _discard(data: bytes) -> None:
    pass


def _ignore(exc: BaseException | None) -> None:
    pass


_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")

# Body framing states of a connection.
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _IDLE = range(8)


class _Connection(asyncio.Protocol):
    """One TCP (or TLS) connection and the response being read on it."""

    def __init__(self, pool: Http1Pool) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._state = _IDLE
        self._buf = b""  # unparsed bytes (head, chunk-size line, trailer)
        self._remaining = 0  # body bytes left (Content-Length) or of the current chunk
        self._head_waiter: asyncio.Future[Response] | None = None
        self._response: Response | None = None
        self._keep_alive = True
        self.paused = False
        self.closed = False
        self.aborted = False  # closed by us, not by the server
        self.received = False  # any byte of the current response
        self.idle_since = 0.0
        self._close_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._feed(data)
        except ProtocolViolation as exc:
            self._fail(exc)

    def eof_received(self) -> bool | None:
        if self._state == _UNTIL_CLOSE:
            self._complete()
        return None  # let the transport close

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._close_timer is not None:
            self._close_timer.cancel()
        self._pool._forget(self)
        if self._state == _UNTIL_CLOSE and not self.aborted:
            self._complete()  # the server's close is what ends such a body
            return
        self._fail(ServerDisconnected("the server closed the connection"
                                      + (f": {exc}" if exc else "")))

    # -- requests ------------------------------------------------------------

    def send(self, request: bytes) -> asyncio.Future[Response]:
        assert self.transport is not None
        assert self._state == _IDLE
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        self._head_waiter = asyncio.get_running_loop().create_future()
        self._state = _HEAD
        self._buf = b""
        self._keep_alive = True
        self.received = False
        self.resume()
        self.transport.write(request)
        return self._head_waiter

    def pause(self) -> None:
        if not self.paused and self.transport is not None and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def abort(self) -> None:
        """Close now. ``transport.abort()`` alone closes the socket only after
        the rest of this event-loop iteration has run, and a loaded worker's
        iteration is long (every other job woken with it relays its chunks
        first); shutdown() on a duplicate of the descriptor sends the FIN at
        once (transport sockets refuse shutdown() themselves)."""
        if self.closed or self.transport is None:
            return
        self.closed = self.aborted = True
        self._pool._forget(self)
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                dup = socket.socket(fileno=os.dup(sock.fileno()))
            except OSError:
                dup = None
            if dup is not None:
                try:
                    dup.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # already closed by the peer
                finally:
                    dup.close()
        self.transport.abort()

    def close_after(self, grace: float) -> None:
        self._close_timer = asyncio.get_running_loop().call_later(grace, self.abort)

    # -- parsing ---------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        state = self._state
        while state == _HEAD:
            data = self._buf + data if self._buf else data
            end = data.find(b"\r\n\r\n")
            if end > MAX_HEAD or (end < 0 and len(data) > MAX_HEAD):
                raise ProtocolViolation("response headers over 64 KiB")
            if end < 0:
                self._buf = data
                return
            self._buf = b""
            self._head(data[:end])  # an interim 1xx response leaves the state at _HEAD
            data = data[end + 4:]
            state = self._state
            if not data:
                return
        if state == _LENGTH:
            n = self._remaining
            if len(data) >= n:
                if len(data) > n:
                    self._keep_alive = False  # bytes we cannot place: never reuse
                if n:
                    self._deliver(data[:n])
                self._complete()
                return
            self._remaining = n - len(data)
            self._deliver(data)
        elif state == _UNTIL_CLOSE:
            self._deliver(data)
        elif state == _IDLE:
            if data:
                raise ProtocolViolation("bytes after the end of the response")
        else:
            self._chunked(data)

    def _head(self, head: bytes) -> None:
        """Parse the status line and headers; an interim 1xx response is skipped."""
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ProtocolViolation(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200:
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise ProtocolViolation(f"malformed header line: {line[:80]!r}")
            key = name.strip().lower().decode("latin-1")
            text = value.strip().decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        connection = headers.get("connection", "").lower()
        self._keep_alive = parts[0] == b"HTTP/1.1" and "close" not in connection
        if status in (204, 304):
            self._state = _LENGTH
            self._remaining = 0
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            self._state = _CHUNK_SIZE
        elif "content-length" in headers:
            length = headers["content-length"]
            if not (length.isascii() and length.isdigit()):
                raise ProtocolViolation(f"bad Content-Length: {length[:40]!r}")
            self._state = _LENGTH
            self._remaining = int(length)
        else:
            self._state = _UNTIL_CLOSE
            self._keep_alive = False
        response = self._response = Response(self, status, headers)
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(response)
        if self._state == _LENGTH and self._remaining == 0:
            self._complete()

    def _chunked(self, data: bytes) -> None:
        """Decode ``Transfer-Encoding: chunked``; one ``_deliver`` per read."""
        if self._state == _CHUNK_SIZE and not self._buf:
            # The usual read of a token stream: exactly one whole chunk
            # (size line without extensions, data, CRLF). Same checks as the
            # loop below, a third of its cost; anything else takes the loop.
            eol = data.find(b"\r\n", 0, 18)
            if eol > 0 and _HEX.fullmatch(data, 0, eol) is not None:
                start = eol + 2
                end = start + int(data[:eol], 16)
                if end > start and len(data) == end + 2 and data.endswith(b"\r\n"):
                    response = self._response
                    if response is not None:
                        response._data(data[start:end])
                    return
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos, size = 0, len(buf)
        state = self._state
        while pos < size:
            if state == _CHUNK_DATA:
                take = min(self._remaining, size - pos)
                out.append(buf[pos:pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if size - pos < 2:
                    self._buf = buf[pos:]
                    pos = size
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise ProtocolViolation("chunk not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            elif state == _CHUNK_SIZE:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > 1024:
                        raise ProtocolViolation("chunk size line over 1 KiB")
                    self._buf = buf[pos:]
                    pos = size
                    break
                line = buf[pos:eol].split(b";", 1)[0].strip()
                # int(x, 16) alone would take "-6", "+5", "0x5" or "0_5": a
                # negative size would step back and parse the same line forever.
                if _HEX.fullmatch(line) is None:
                    raise ProtocolViolation(f"bad chunk size: {line[:40]!r}")
                n = int(line, 16)
                pos = eol + 2
                if n == 0:
                    state = _TRAILER
                else:
                    self._remaining = n
                    state = _CHUNK_DATA
            else:  # _TRAILER: header lines until an empty one
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > MAX_HEAD:
                        raise ProtocolViolation("trailer over 64 KiB")
                    self._buf = buf[pos:]
                    pos = size
                    break
                empty = eol == pos
                pos = eol + 2
                if empty:
                    self._state = _IDLE
                    if out:
                        self._deliver(b"".join(out))
                    self._complete()
                    if pos < size:
                        raise ProtocolViolation("bytes after the end of the response")
                    return
        self._state = state
        if out:
            self._deliver(out[0] if len(out) == 1 else b"".join(out))

    def _deliver(self, body: bytes) -> None:
        response = self._response
        if response is not None:
            response._data(body)

    def _complete(self) -> None:
        response, self._response = self._response, None
        self._state = _IDLE
        if self._close_timer is not None:
            self._close_timer.cancel()
            self._close_timer = None
        if response is not None:
            response._end(None)
        if self._keep_alive and not self.closed:
            # Reading while idle: bytes the server sends now are a protocol
            # violation that closes this connection, never the next answer.
            self.resume()
            self._pool._release(self)
        elif not self.closed:
            self.abort()

    def _fail(self, exc: BaseException) -> None:
        waiter, self._head_waiter = self._head_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        response, self._response = self._response, None
        self._state = _IDLE
        if response is not None:
            response._end(exc)
        if not self.closed:
            self.abort()


class Http1Pool:
    """Keep-alive connections to one origin (``scheme://host:port``)."""

    def __init__(self, base_url: str, *, connect_timeout: float) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        default = 443 if url.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.authority = host if self.port == default else f"{host}:{self.port}"
        self.base_path = url.path.rstrip("/")
        self._ssl = ssl.create_default_context() if url.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._closed = False

    async def request(self, method: str, path: str, headers: bytes, body: bytes) -> Response:
        """Send a request and return once its status and headers arrived.

        ``headers`` are ready ``Name: value\\r\\n`` lines (Host and
        Content-Length are added here; HTTP/1.1 keeps the connection alive).
        Raises :class:`OSError` (:class:`ConnectTimeout` for the connect) when
        no connection could be made,
        :class:`ServerDisconnected` / :class:`ProtocolViolation` for a broken
        answer. The caller bounds the wait for the headers.
        """
        head = (f"{method} {self.base_path}{path} HTTP/1.1\r\nHost: {self.authority}\r\n"
                f"Content-Length: {len(body)}\r\n").encode("latin-1")
        message = head + headers + b"\r\n" + body
        while True:
            conn = self._take_idle()
            fresh = conn is None
            if conn is None:
                conn = await self._connect()
            waiter = conn.send(message)
            try:
                return await waiter
            except ServerDisconnected:
                # The keep-alive race: a reused connection the server closed
                # before reading our request. Nothing was answered; retry once
                # on a new connection. A fresh connection failing is an error.
                if fresh or conn.received:
                    raise
            except BaseException:
                conn.abort()
                raise

    def _take_idle(self) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed and now - conn.idle_since < KEEPALIVE:
                return conn
            conn.abort()
        return None

    async def _connect(self) -> _Connection:
        if self._closed:
            raise ConnectionError("the backend client is closed")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self), self.host, self.port, ssl=self._ssl,
                    server_hostname=self.host if self._ssl is not None else None)
        except TimeoutError:
            raise ConnectTimeout(f"no connection to {self.authority} within "
                                 f"{self._connect_timeout:g}s") from None
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._open.add(conn)
        return conn

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = asyncio.get_running_loop().time()
        self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)

    @property
    def idle(self) -> int:
        """Pooled connections waiting for a request."""
        return len(self._idle)

    def close(self) -> None:
        """Close every connection, idle or in use."""
        self._closed = True
        for conn in list(self._open):
            conn.abort()
        self._idle.clear()
