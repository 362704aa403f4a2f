"""``GET /v1/ws``: the WebSocket ingress (protocol: docs/websocket.md).

A thin adapter: the frame protocol is sans-I/O in :mod:`tidegate.wire.ws`, and
each generation is an ordinary request (``edge.publish``, :class:`edge.relay.Relay`
writing through :class:`edge.ws_writer.WsWriter`), so quotas, queue mode,
cancel and flow control are exactly those of SSE.

Tasks: one ``asyncio.TaskGroup`` per socket owns the keepalive and one task per
generation; when the reader ends, every running generation is cancelled, and
its work upstream. The key is checked per ``request``/``resume`` frame, and a
revoke or expiry closes the socket with 4401 at once. Close codes:
:class:`tidegate.wire.ws.CloseCode`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

from aiohttp import WSMsgType, web
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict

from edge import anthropic, instrument, resume, ws_resume
from edge.auth import KeyTable, Principal, authorization
from edge.continuation import deciding_fields
from edge.endings import Reconnect, SlowClient
from edge.logreader import LogReader
from edge.publish import build_request, models_for, publish_request
from edge.relay import Relay
from edge.state import STATE, EdgeState, session_tick, set_keepalive
from edge.writer import cancel_error
from edge.ws_writer import WsWriter
from tidegate import apis
from tidegate.apis import WEBSOCKET_PATHS
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.errors import ApiError, unavailable
from tidegate.telemetry import logs
from tidegate.validation.jsonbody import parse_object
from tidegate.wire import ws as wire
from tidegate.wire.ws import CloseCode, KeepaliveAction

log = logging.getLogger("tidegate.edge")


async def websocket(http: web.Request) -> web.StreamResponse:
    """The route: authenticate (header, if any), upgrade, run the socket."""
    state = http.app[STATE]
    if state.draining:
        raise unavailable("This edge is shutting down; retry on another.", code="edge_draining")
    header = authorization(http.headers)
    principal = state.keys.authenticate(header) if header else None
    digest = KeyTable.digest_of(header) if header else ""
    cfg = state.config.ws
    ws = web.WebSocketResponse(autoping=False, autoclose=True, heartbeat=None,
                               compress=cfg.compress, max_msg_size=cfg.max_message_bytes,
                               decode_text=False)
    if not ws.can_prepare(http).ok:
        raise ApiError(426, "GET /v1/ws expects a WebSocket upgrade.",
                       type="invalid_request_error", code="upgrade_required")
    writer = await ws.prepare(http)
    set_keepalive(http.transport, state.config.edge)
    socket = WsSocket(state, http, ws, writer, principal, digest)
    state.sockets.add(socket)
    try:
        await socket.run()
    finally:
        state.sockets.remove(socket)
    return ws


@dataclasses.dataclass(slots=True, eq=False)
class _Generation:
    id: str
    task: asyncio.Task[None] | None = None
    relay: Relay | None = None
    cancel_requested: bool = False
    resumed: str = ""  # request id, for a generation that is a resume of a stream
    reader: LogReader | None = None


class WsSocket:
    """One open socket: reads frames, starts and cancels generations, pings."""

    def __init__(self, state: EdgeState, http: web.Request, ws: web.WebSocketResponse,
                 writer: AbstractStreamWriter, principal: Principal | None,
                 digest: str = "") -> None:
        cfg = state.config
        self.state = state
        self.http = http
        self.ws = ws
        self._writer = writer
        self.principal = principal
        self._digest = digest  # the key's, once authenticated
        self._key_changed = asyncio.Event()
        self._revoked_by: asyncio.Task[Any] | None = None  # the task closing for the key
        self.raw = not cfg.ws.compress
        self.high_water = max(4096, cfg.session.window_bytes // 4)
        self.conn = wire.Connection(cfg.ws.max_concurrent, authenticated=principal is not None)
        now = time.monotonic()
        self.keepalive = wire.Keepalive(
            idle_before_ping=cfg.ws.idle_before_ping, ping_interval=cfg.ws.ping_interval,
            pong_timeout=cfg.ws.pong_timeout, max_missed=cfg.ws.max_missed_pongs, now=now)
        self._gens: dict[str, _Generation] = {}
        self._tg: asyncio.TaskGroup | None = None
        self._closing = False
        # The read loop's task; while it waits in receive(), a close asked for
        # elsewhere (_close_with) interrupts it, and it closes.
        self._reader: asyncio.Task[Any] | None = None
        self._receiving = False
        self._close_with: tuple[CloseCode, bytes] | None = None
        self._read_ended = asyncio.Event()
        transport = http.transport
        if transport is not None:
            # One bound for everything the socket's generations have written and
            # the client has not read: above it, every generation waits to ack.
            transport.set_write_buffer_limits(high=self.high_water, low=self.high_water // 2)

    @property
    def generations(self) -> int:
        return len(self._gens)

    def resumed_tasks(self) -> list[asyncio.Task[None]]:
        return [g.task for g in self._gens.values() if g.resumed and g.task is not None]

    def _loads(self, data: bytes | str) -> Any:
        """A frame's JSON, by the HTTP body's strict, depth-bounded parser."""
        raw = data.encode() if isinstance(data, str) else data
        return parse_object(raw, self.state.config.edge.max_json_depth)

    # -- writing -----------------------------------------------------------

    def sent(self, now: float) -> None:
        self.keepalive.sent(now)

    async def send(self, payloads: list[bytes]) -> None:
        """Write text frames. Past the high-water mark, wait for the client to
        read, at most edge.slow_client_timeout (then the socket is dropped)."""
        transport = self.http.transport
        if transport is None or transport.is_closing() or self.ws.closed:
            raise ConnectionResetError("the WebSocket is closed")
        if self.raw:
            transport.write(b"".join([wire.encode_text_frame(p) for p in payloads]))
        else:
            for payload in payloads:
                await self.ws.send_frame(payload, WSMsgType.TEXT)
        self.keepalive.sent(time.monotonic())
        if transport.get_write_buffer_size() > self.high_water:
            try:
                async with asyncio.timeout(self.state.config.edge.slow_client_timeout):
                    await self._writer.drain()
            except TimeoutError:
                transport.abort()
                raise SlowClient() from None

    async def _send_quietly(self, payload: bytes) -> None:
        with contextlib.suppress(ConnectionError, RuntimeError, SlowClient):
            await self.send([payload])

    # -- the socket's life ---------------------------------------------------

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                keepalive = tg.create_task(self._keepalive(), name="tidegate-ws-keepalive")
                watcher: asyncio.Task[None] | None = None
                unwatch = None
                try:
                    if self.principal is None:
                        await self._authenticate()
                    if self.principal is not None:
                        unwatch = self.state.keys.watch(self._digest, self._on_key_change)
                        watcher = tg.create_task(self._follow_key(), name="tidegate-ws-key")
                        await self._read_loop()
                finally:
                    self._closing = True
                    keepalive.cancel()
                    if unwatch is not None:
                        unwatch()
                    if watcher is not None and watcher is not self._revoked_by:
                        watcher.cancel()  # (its own close handshake is left to finish)
                    for gen in list(self._gens.values()):
                        if gen.task is not None:
                            gen.task.cancel()
        finally:
            self.conn.closed()
            if not self.ws.closed:
                with contextlib.suppress(Exception):
                    await self.ws.close()

    async def _authenticate(self) -> None:
        """First-message auth: an ``auth`` frame within ws.auth_timeout."""
        try:
            async with asyncio.timeout(self.state.config.ws.auth_timeout):
                while self.principal is None:
                    msg = await self.ws.receive()
                    if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED,
                                    WSMsgType.ERROR):
                        return
                    self.keepalive.received(time.monotonic())
                    if msg.type in (WSMsgType.PING, WSMsgType.PONG):
                        if msg.type is WSMsgType.PING:
                            await self.ws.pong(msg.data)
                        continue
                    event = self.conn.receive(wire.parse_client_frame(
                        msg.data, WEBSOCKET_PATHS, binary=msg.type is not WSMsgType.TEXT,
                        loads=self._loads))
                    if isinstance(event, wire.Ping):
                        await self._send_quietly(wire.PONG)
                        continue
                    if isinstance(event, wire.Invalid):
                        if event.error.type == "authentication_error":
                            await self._close(CloseCode.AUTH_FAILED, event.error)
                            return
                        await self._send_quietly(wire.error(event.error, event.id))
                        continue
                    if isinstance(event, wire.Auth):
                        authorization = f"Bearer {event.key}"
                        try:
                            self.principal = self.state.keys.authenticate(authorization)
                        except ApiError as error:
                            await self._close(CloseCode.AUTH_FAILED, error)
                            return
                        self._digest = KeyTable.digest_of(authorization)
                        self.conn.authenticated()
        except TimeoutError:
            await self._close(CloseCode.AUTH_TIMEOUT, ApiError(
                401, "No auth frame within the deadline.", type="authentication_error",
                code="auth_timeout"))

    async def _close(self, code: CloseCode, error: ApiError) -> None:
        # The reason is at most 123 bytes (RFC 6455 5.5): the code, then as
        # much of the message as fits.
        await self._close_elsewhere(code, f"{error.code}: {error.message}".encode()[:123])

    async def _read_loop(self) -> None:
        ws = self.ws
        self._reader = asyncio.current_task()
        try:
            while not ws.closed:
                if self._close_with is not None:
                    code, reason = self._close_with
                    with contextlib.suppress(Exception):
                        await ws.close(code=int(code), message=reason)
                    return
                self._receiving = True
                try:
                    msg = await ws.receive()
                except asyncio.CancelledError:
                    # Our own interruption (see _close_elsewhere) is taken
                    # back; any other cancel goes on.
                    reader = self._reader
                    if self._close_with is None or reader is None or reader.uncancel() > 0:
                        raise
                    continue
                finally:
                    self._receiving = False
                kind = msg.type
                if kind in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED,
                            WSMsgType.ERROR):
                    return  # an over-size frame: aiohttp has already closed with 1009
                self.keepalive.received(time.monotonic())
                if kind is WSMsgType.PING:
                    await ws.pong(msg.data)
                    continue
                if kind is WSMsgType.PONG:
                    continue
                event = self.conn.receive(wire.parse_client_frame(
                    msg.data, WEBSOCKET_PATHS, binary=kind is not WSMsgType.TEXT,
                    loads=self._loads))
                await self._on_event(event)
        finally:
            self._read_ended.set()

    async def _close_elsewhere(self, code: CloseCode, reason: bytes) -> None:
        """Close from a task other than the reader's (the key's watcher, a
        drain): the reader does it. aiohttp's close() while another task waits
        in receive() drops TCP at once without the peer's Close; a frame the
        client sent meanwhile turns the drop into a reset, and the client can
        lose our Close frame and its code (tests/test_ws_revoke.py)."""
        reader = self._reader
        if reader is None or reader is asyncio.current_task() or self._read_ended.is_set():
            with contextlib.suppress(Exception):
                await self.ws.close(code=int(code), message=reason)
            return
        if self._close_with is None:
            self._close_with = (code, reason)
            if self._receiving:
                reader.cancel()
        await self._read_ended.wait()

    async def _on_event(self, event: wire.ClientEvent) -> None:
        if isinstance(event, wire.StartRequest | wire.ResumeRequest):
            # Per generation, as HTTP per request: a key revoked or expired
            # since the socket authenticated starts nothing more.
            try:
                self.principal = self.state.keys.check(self._digest)
            except ApiError as error:
                self.conn.finish(event.id)
                await self._send_quietly(wire.error(error, event.id))
                await self._revoke(error)
                return
        if isinstance(event, wire.StartRequest):
            self._start(event)
        elif isinstance(event, wire.CancelRequest):
            self._cancel(event.id)
        elif isinstance(event, wire.Ping):
            await self._send_quietly(wire.PONG)
        elif isinstance(event, wire.Pong):
            pass  # the keepalive already counted it as traffic
        elif isinstance(event, wire.ResumeRequest):
            self._start(event)
        elif isinstance(event, wire.Invalid):
            await self._send_quietly(wire.error(event.error, event.id))

    # -- generations -----------------------------------------------------------

    def _start(self, event: wire.StartRequest | wire.ResumeRequest) -> None:
        assert self._tg is not None
        gen = _Generation(event.id)
        if isinstance(event, wire.ResumeRequest):
            gen.resumed = event.request_id
        self._gens[event.id] = gen
        gen.task = self._tg.create_task(self._generation(gen, event),
                                        name=f"tidegate-ws-gen-{event.id[:16]}")

    def _cancel(self, id: str) -> None:
        gen = self._gens.get(id)
        if gen is None or gen.cancel_requested:
            return
        gen.cancel_requested = True
        if gen.relay is not None:
            gen.relay.session.abort(cancel_error())
        elif gen.resumed and self._tg is not None:
            # A resumed stream runs elsewhere: cancel it as POST
            # /v1/streams/{id}/cancel does; its log then ends, and the
            # replay answers ``cancelled``.
            self._tg.create_task(self._cancel_stream(gen.resumed),
                                 name="tidegate-ws-cancel-stream")

    async def _cancel_stream(self, request_id: str) -> None:
        assert self.principal is not None
        state = self.state
        try:
            await resume.cancel_stream(request_id, self.principal.tenant, state.sessions,
                                       state.streamlog, state.relay.publisher.tombstone)
        except ApiError as error:
            log.info("WebSocket cancel of resumed stream %s: %s", request_id, error.code)

    async def _generation(self, gen: _Generation,
                          event: wire.StartRequest | wire.ResumeRequest) -> None:
        """One generation, start to end. Never raises (but CancelledError):
        a failure is this generation's error frame, not the socket's end."""
        state = self.state
        assert self.principal is not None
        api = event.api if isinstance(event, wire.StartRequest) else CHAT.api
        rt = instrument.RequestTelemetry(state.telemetry, self.http.headers, api)
        if rt.span is not None:
            rt.span.set_attribute("tidegate.transport", "websocket")
        token = rt.activate()
        status = 200
        try:
            if isinstance(event, wire.ResumeRequest):
                await self._run_resume(gen, event)
            else:
                await self._run_generation(gen, event, rt)
        except ApiError as error:
            rt.on_error(error)
            status = error.status
            await self._send_quietly(wire.error(error, gen.id))
        except asyncio.CancelledError:
            rt.on_cancel("client_disconnected")
            raise
        except (ConnectionError, SlowClient):
            rt.on_cancel("client_disconnected")
        except Exception:
            status = 500
            log.exception("WebSocket generation %s failed", gen.id)
            await self._send_quietly(wire.error(ApiError(
                500, "Internal gateway error.", type="server_error", code="internal_error"),
                gen.id))
        finally:
            rt.finish(status)
            instrument.deactivate(token)
            self._gens.pop(gen.id, None)
            self.conn.finish(gen.id)
            if self.conn.state is wire.SocketState.DRAINING and not self._gens:
                await self.close_restart()

    async def _run_generation(self, gen: _Generation, event: wire.StartRequest,
                              rt: instrument.RequestTelemetry) -> None:
        state = self.state
        assert self.principal is not None
        models = models_for(state, self.principal)
        valid = apis.of(event.api).validate_body(event.body, models)
        headers: object = self.http.headers
        if event.resumable is not None or event.resume_grace is not None:
            # The frame's own opt-in, in the header names resume_grace reads.
            merged = CIMultiDict(self.http.headers)
            if event.resumable is not None:
                merged[resume.RESUMABLE_HEADER] = "true" if event.resumable else "false"
            if event.resume_grace is not None:
                merged[resume.GRACE_HEADER] = str(event.resume_grace)
            headers = merged
        grace = resume.resume_grace(headers, state.tenants, self.principal.tenant, valid.model,
                                    state.config)
        request = build_request(state, self.principal, valid, rt.carrier, grace)
        if apis.of(request.api).anthropic:
            request = anthropic.prepare(request, self.http.headers)
        rt.started_request(request)
        del valid
        # Subscribed (session open) before publishing, as for SSE.
        session = state.sessions.open(request.id, session_tick(state.config),
                                      self.principal.tenant)
        log_token = logs.bind(request.id, request.tenant, rt.trace_id)
        try:
            seq = (await publish_request(state, request, rt.carrier)).seq
            headers = {"x-request-id": request.id, "x-tidegate-request-seq": str(seq)}
            request = dataclasses.replace(request, body=deciding_fields(request.body))
            relay = Relay(WsWriter(self, gen.id, request), session, request, state.relay,
                          headers)
            gen.relay = relay
            if gen.cancel_requested:
                session.abort(cancel_error())
            await relay.run()
        finally:
            state.sessions.close(session)
            logs.unbind(log_token)

    async def _run_resume(self, gen: _Generation, event: wire.ResumeRequest) -> None:
        assert self.principal is not None
        async with self.state.streamlog.read(event.request_id, self.principal.tenant,
                                             event.after) as reader:
            if not reader.open.stream:
                raise ApiError(400, "This stream is a non-streaming request's; read its body "
                                    "with GET /v1/streams/{request_id}.",
                               type="invalid_request_error", code="not_a_stream",
                               param="request_id")
            gen.reader = reader
            await ws_resume.replay(self, gen.id, reader)

    # -- the key -------------------------------------------------------------------

    def _on_key_change(self, principal: Principal | None) -> None:
        # Called from the key table's KV watch: only take note here.
        self._key_changed.set()

    async def _follow_key(self) -> None:
        """Close the socket (4401) when its key is revoked or expires, idle or
        not: woken by the key table's listener, or by the key's expiry time."""
        keys = self.state.keys
        while True:
            self._key_changed.clear()
            try:
                principal = keys.check(self._digest)
            except ApiError as error:
                await self._revoke(error)
                return
            self.principal = principal
            left = principal.expires - time.time() if principal.expires else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._key_changed.wait()

    async def _revoke(self, error: ApiError) -> None:
        """The key no longer holds: cancel every generation (their relays
        cancel the work upstream) and close with 4401 and the reason."""
        if self._revoked_by is not None:
            return
        self._revoked_by = asyncio.current_task()
        self._closing = True
        log.info("WebSocket: %s; closing the socket and cancelling its %d generations",
                 error.code, len(self._gens))
        for gen in list(self._gens.values()):
            if gen.task is not None:
                gen.task.cancel()
        await self._close(CloseCode.AUTH_FAILED, error)

    # -- liveness and shutdown ---------------------------------------------------

    async def _keepalive(self) -> None:
        cfg = self.state.config.ws
        ka = self.keepalive
        while True:
            now = time.monotonic()
            action = ka.poll(now)
            if action is KeepaliveAction.PING:
                transport = self.http.transport
                if transport is not None and not transport.is_closing():
                    # Straight to the transport: a control frame is never
                    # compressed, and a ping must not wait behind a full buffer
                    # (aiohttp's ping() may), or a dead peer is never found.
                    transport.write(wire.PING_FRAME)
                    if cfg.app_pings:
                        transport.write(wire.encode_text_frame(wire.PING))
            elif action is KeepaliveAction.EVICT:
                log.info("WebSocket: %d pings unanswered; closing the socket and cancelling "
                         "its %d generations", ka.missed, len(self._gens))
                self._evict()
                return
            # Sleep until the keepalive's next deadline (at least 50 ms).
            await asyncio.sleep(max(ka.next_check(time.monotonic()), 0.05))

    def _evict(self) -> None:
        """The peer is gone: cancel every generation (upstream cancels go out
        at once from their relays), then drop the socket without waiting for
        a close handshake nobody will answer."""
        self._closing = True
        for gen in list(self._gens.values()):
            if gen.task is not None:
                gen.task.cancel()
        transport = self.http.transport
        if transport is not None and not transport.is_closing():
            transport.write(wire.close_frame(CloseCode.INTERNAL_ERROR, b"ping timeout"))
            transport.abort()

    def drain(self) -> None:
        """SIGTERM: no new generations. Resumable ones are told to reconnect
        (``reconnect`` frame) and go on without this socket, in their grace;
        the others run on until edge.shutdown_timeout. The socket closes with
        1012 once the last has left.

        A resumed generation (a ``resume`` frame) is not cancelled: its reader
        sees the edge's drain itself (``StreamLog.drain``) and the replay ends
        with the reconnect frame after the last event it sent
        (``edge.ws_resume``); a cancelled read could count an event it never
        sent, and the client would resume past it."""
        self.conn.drain()
        if self._tg is None or self._closing:
            return
        for gen in list(self._gens.values()):
            if gen.relay is not None and gen.relay.request.resumable:
                gen.relay.session.abort(Reconnect())
        if not self._gens:
            self._tg.create_task(self.close_restart(), name="tidegate-ws-close")

    async def close_restart(self) -> None:
        await self._close_elsewhere(CloseCode.SERVICE_RESTART, b"edge restarting: reconnect")
