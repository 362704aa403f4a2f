"""Connection-level defences of the edge's HTTP/1.1 server.

aiohttp bounds the request line and headers but has no header deadline and no
connection caps; :class:`GuardedHandler` and :class:`GuardedSite` add them:

* a first complete header block within ``edge.header_timeout`` or 408 (slowloris);
* at most ``edge.max_connections`` per edge and ``edge.max_connections_per_ip``
  per address, past which a complete 503 is written before anything is parsed;
* parse errors as OpenAI 400 bodies, logged at a rate limit;
* no header value echoed (a parse error could quote an API key).

Only the inbound side is touched, so the per-chunk path is unchanged; the body
deadline lives where bodies are read. Docs: docs/security.md#connections-edgeguardpy.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from tidegate.config import EdgeConfig
from tidegate.errors import ApiError
from tidegate.telemetry import telemetry
from tidegate.telemetry.untrusted import RateLimitedLog

log = logging.getLogger("tidegate.edge")
_log = RateLimitedLog(log)
_HEADER_END = b"\r\n\r\n"
# Bytes kept of the header line being received: room for any real header
# name and its colon (the value after it is never read from here).
_NAME_BYTES = 64
_TOKEN = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,63}")
# What aiohttp quotes from the request in a parse error: b'...' / '...' reprs
# and, from its C parser, the offending bytes on lines of their own.
_QUOTED = re.compile(r"b?'(?:[^'\\]|\\.)*'" + r'|b?"(?:[^"\\]|\\.)*"')


def canned_response(error: ApiError, *, close: bool = True) -> bytes:
    """A complete HTTP/1.1 error response, for when no handler will run."""
    body = error.to_json()
    head = [f"HTTP/1.1 {error.status} {_REASONS.get(error.status, 'Error')}",
            "Content-Type: application/json", f"Content-Length: {len(body)}"]
    if error.retry_after > 0:
        head.append(f"Retry-After: {max(1, round(error.retry_after))}")
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Payload Too Large",
            500: "Internal Server Error", 503: "Service Unavailable"}


class ConnectionLimits:
    """Open connections per edge and per client address."""

    __slots__ = ("by_ip", "per_ip", "total", "total_max")

    def __init__(self, total_max: int, per_ip: int) -> None:
        self.total_max = total_max
        self.per_ip = per_ip
        self.total = 0
        self.by_ip: Counter[str] = Counter()

    def admit(self, ip: str) -> str | None:
        """Take a slot for ``ip``; the refusal reason when there is none."""
        if self.total_max and self.total >= self.total_max:
            return "max_connections"
        if self.per_ip and self.by_ip[ip] >= self.per_ip:
            return "max_per_ip"
        self.total += 1
        self.by_ip[ip] += 1
        return None

    def release(self, ip: str) -> None:
        self.total -= 1
        self.by_ip[ip] -= 1
        if self.by_ip[ip] <= 0:
            del self.by_ip[ip]


def _refused(reason: str) -> None:
    telemetry.get().metrics.edge_connections_refused.add(1, {telemetry.REASON: reason})


class GuardedHandler(RequestHandler):
    """aiohttp's request handler with a header deadline and connection caps."""

    __slots__ = ("_admitted", "_deadline", "_field_limit", "_guard_limits", "_header_timeout",
                 "_ip", "_line", "_line_len", "_line_limit", "_lines", "_overlong", "_tail")

    def __init__(self, manager: web.Server, *, limits: ConnectionLimits,
                 header_timeout: float, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard_limits = limits
        self._header_timeout = header_timeout
        self._admitted = False
        self._ip = ""
        self._deadline: asyncio.TimerHandle | None = None
        # The last bytes of an unfinished header block, to find a blank line
        # split across two reads; None once the first header block is complete.
        self._tail: bytes | None = b""
        # While the first header block arrives: the start and length of the
        # line being received, whether a line ended before it (so it is a
        # header, not the request line), and the start of the first line over
        # its limit (b"" for the request line), to name it in the 400.
        self._line_limit = int(kwargs.get("max_line_size", 8190))
        self._field_limit = int(kwargs.get("max_field_size", 8190))
        self._line = b""
        self._line_len = 0
        self._lines = False
        self._overlong: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._ip = str(peer[0]) if isinstance(peer, tuple) and peer else "unix"
        refusal = self._guard_limits.admit(self._ip)
        if refusal is not None:
            _refused(refusal)
            _log.warning(refusal, "refused a connection from %s: %s reached", self._ip, refusal)
            error = ApiError(503, "This gateway node has too many open connections"
                             + (" from your address" if refusal == "max_per_ip" else "")
                             + "; retry shortly.", type="service_unavailable",
                             code="too_many_connections", retryable=True, retry_after=1)
            assert isinstance(transport, asyncio.Transport)
            transport.write(canned_response(error))
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)
        if self._header_timeout > 0:
            self._deadline = self._loop.call_later(self._header_timeout, self._header_expired)

    def data_received(self, data: bytes) -> None:
        if not self._admitted:
            return
        if self._tail is not None:
            seen = self._tail + data
            end = seen.find(_HEADER_END)
            if self._overlong is None:
                self._track_lines(data if end < 0 else data[:max(0, end + 4 - len(self._tail))])
            if end >= 0:
                self._tail = None
                if self._deadline is not None:
                    self._deadline.cancel()
                    self._deadline = None
            else:
                self._tail = seen[-3:]
        super().data_received(data)

    def _track_lines(self, data: bytes) -> None:
        """Follow the first header block's lines until one is over its
        limit. Only the header phase of a connection's first request pays
        for this (one ``find`` per line), never a body or a response."""
        start = 0
        while True:
            end = data.find(b"\n", start)
            piece = data[start:] if end < 0 else data[start:end]
            if len(self._line) < _NAME_BYTES:
                self._line += piece[:_NAME_BYTES - len(self._line)]
            self._line_len += len(piece)
            if self._line_len > (self._field_limit if self._lines else self._line_limit):
                self._overlong = self._line if self._lines else b""
                return
            if end < 0:
                return
            self._line, self._line_len, self._lines = b"", 0, True
            start = end + 1

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._admitted:
            return
        self._admitted = False
        self._guard_limits.release(self._ip)
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _header_expired(self) -> None:
        self._deadline = None
        if self._tail is None or self.transport is None:
            return
        _refused("header_timeout")
        _log.warning("header_timeout", "closed a connection from %s: no complete request "
                     "headers within %.0fs", self._ip, self._header_timeout)
        error = ApiError(408, f"The request headers did not arrive within "
                         f"{self._header_timeout:g} seconds.", type="invalid_request_error",
                         code="request_timeout")
        self.transport.write(canned_response(error))
        self.force_close()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp calls this for a request it could not parse (and for errors
        # that escaped the app, which errors_middleware already prevents).
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if status >= 500:
            log.error("error handling a request from %s", self._ip, exc_info=exc)
            error = ApiError(status, "Internal gateway error.", type="server_error",
                             code="internal_error")
        else:
            _refused("bad_http")
            reason = self._reason(exc, message)
            _log.warning("bad_http", "bad HTTP request from %s: %s", self._ip, reason)
            error = ApiError(status, f"The HTTP request is malformed: {reason}",
                             type="invalid_request_error", code="invalid_http")
        response = web.Response(status=error.status, body=error.to_json(),
                                content_type="application/json")
        response.force_close()
        return response

    def _reason(self, exc: BaseException | None, message: str | None) -> str:
        """What was wrong with an unparsable request, without its bytes."""
        if isinstance(exc, LineTooLong):
            limit = exc.args[1] if len(exc.args) > 1 else self._field_limit
            return (f"the {self._overlong_line()} is longer than {limit} bytes, the edge's limit "
                    "(its value is not shown).")
        reason = (message or (str(exc) if exc else "") or "malformed request")
        reason = reason.strip().removeprefix("400, message:").strip().split("\n", 1)[0]
        return _QUOTED.sub("(not shown)", reason)[:200] or "malformed request"

    def _overlong_line(self) -> str:
        if self._overlong is None:  # not found (a later request on a kept-alive connection)
            return "request line or a header line"
        if not self._overlong:
            return "request line"
        name, colon, _ = self._overlong.partition(b":")
        if colon and _TOKEN.fullmatch(name):
            return f"header '{name.decode('ascii')}'"
        return "header line"


class GuardedSite(web.TCPSite):
    """A TCP site whose connections are served by :class:`GuardedHandler`."""

    def __init__(self, runner: web.AppRunner, config: EdgeConfig, **kwargs: Any) -> None:
        super().__init__(runner, config.host, config.port, **kwargs)
        self.limits = ConnectionLimits(config.max_connections, config.max_connections_per_ip)
        self._edge = config

    async def start(self) -> None:
        # BaseSite.start registers the site; TCPSite.start would create the
        # server with aiohttp's own handler factory, so it is done here.
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        config = self._edge

        def factory() -> GuardedHandler:
            return GuardedHandler(
                server, loop=loop, limits=self.limits, header_timeout=config.header_timeout,
                access_log=None, keepalive_timeout=config.idle_timeout,
                max_line_size=config.max_line_size, max_field_size=config.max_field_size,
                max_headers=config.max_headers)

        self._server = await loop.create_server(
            factory, self._host, self._port, ssl=self._ssl_context, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
