"""``tidegate.v1.Gateway/Session``: many generations on one bidirectional call.

The WebSocket protocol's semantics in protobuf: each ``SessionRequest`` names
a generation by the client's ``id``; ``generate`` starts one, ``cancel`` ends
it (``Cancelled`` is its last message), ``resume`` attaches to a resumable
stream of the caller's tenant. A generation's failure is an ``Error`` message;
the call ends with a status only for what concerns all of it (key revoked,
reader too slow).

Tasks: the reader and one per generation; when the call ends every running
generation is cancelled, and so is its work upstream. Docs: docs/grpc.md#session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from edge import instrument, resume
from edge.auth import KeyTable, Principal
from edge.errors import from_info
from edge.grpc_calls import (
    CallSink,
    Generation,
    api_of,
    error_message,
    metadata_of,
    run_generation,
    undecodable,
)
from edge.logreader import Draining, LogReader
from edge.relay import Relay
from edge.state import EdgeState
from edge.writer import CANCEL_CODES, cancel_error
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.errors import ApiError, invalid_request, unavailable
from tidegate.wire import gateway_pb2 as pb
from tidegate.wire.streamlog import LogEvent

log = logging.getLogger("tidegate.edge")

MAX_ID_LENGTH = 128  # ids are echoed in every message of their generation


async def run_session(state: EdgeState, requests: Any,
                      context: grpc.aio.ServicerContext[Any, Any],
                      sink: CallSink, open_calls: set[SessionCall]) -> ApiError | None:
    """Serve one Session call; returns the error the call ends with, if any.
    ``open_calls``: the edge's open Session calls (drain reaches them there)."""
    try:
        metadata = metadata_of(context)
        authorization = metadata.get("authorization")
        principal = state.keys.authenticate(authorization)
    except ApiError as error:
        return error
    assert authorization is not None
    call = SessionCall(state, requests, context, sink, principal,
                       KeyTable.digest_of(authorization), metadata)
    open_calls.add(call)
    try:
        return await call.run()
    finally:
        open_calls.discard(call)


class SessionCall:
    """One open Session call."""

    def __init__(self, state: EdgeState, requests: Any,
                 context: grpc.aio.ServicerContext[Any, Any], sink: CallSink,
                 principal: Principal, digest: str, metadata: dict[str, str]) -> None:
        self.state = state
        self.requests = requests
        self.context = context
        self.sink = sink
        self.principal = principal
        self.digest = digest
        self.metadata = metadata
        self.gens: dict[str, Generation] = {}
        self.failure: ApiError | None = None
        self.reading = True
        self.ended = asyncio.Event()
        self._key_changed = asyncio.Event()
        self._aux: set[asyncio.Task[None]] = set()  # error replies, remote cancels

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.create_task(coro)
        self._aux.add(task)  # held: a task without a reference may be collected
        task.add_done_callback(self._aux.discard)

    async def run(self) -> ApiError | None:
        reader = asyncio.create_task(self._read(), name="tidegate-grpc-session-read")
        unwatch = self.state.keys.watch(self.digest, lambda _: self._key_changed.set())
        follower = asyncio.create_task(self._follow_key(), name="tidegate-grpc-session-key")
        try:
            await self.ended.wait()
        finally:
            unwatch()
            follower.cancel()
            reader.cancel()
            tasks = [g.task for g in self.gens.values() if g.task is not None]
            for task in tasks:
                task.cancel()
            for task in self._aux:
                task.cancel()
            await asyncio.gather(reader, follower, *tasks, *self._aux, return_exceptions=True)
        return self.failure

    async def _follow_key(self) -> None:
        """End the call (UNAUTHENTICATED, every generation cancelled upstream)
        when its key is revoked or expires, idle or not: woken by the key
        table's listener, or by the key's expiry time (as a WebSocket)."""
        keys = self.state.keys
        while True:
            self._key_changed.clear()
            try:
                self.principal = keys.check(self.digest)
            except ApiError as error:
                log.info("gRPC Session: %s; ending the call and its %d generations",
                         error.code, len(self.gens))
                self._fail(error)
                return
            expires = self.principal.expires
            left = expires - time.time() if expires else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._key_changed.wait()

    def _maybe_end(self) -> None:
        if self.failure is not None or (not self.gens and (
                not self.reading or self.state.draining)):
            self.ended.set()

    def drain(self) -> None:
        """The edge drains: no new generations; an idle call ends now, the
        others once their generations have (resumable ones get Reconnect)."""
        self._maybe_end()

    def _fail(self, error: ApiError) -> None:
        if self.failure is None:
            self.failure = error
        self.ended.set()

    async def _read(self) -> None:
        try:
            async for msg in self.requests:
                await self._on_message(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the call broke (client reset): end it
            log.debug("gRPC Session read ended: %s", exc)
        finally:
            self.reading = False
            self._maybe_end()

    async def _send_error(self, gen_id: str, error: ApiError) -> None:
        with contextlib.suppress(Exception):
            await self.sink.send(error_message(gen_id, error))

    async def _on_message(self, msg: pb.SessionRequest | None) -> None:
        if msg is None:  # not a SessionRequest (edge.grpc_calls.lenient): no id to answer to
            await self._send_error("", undecodable(pb.SessionRequest))
            return
        gen_id = msg.id
        action = msg.WhichOneof("action")
        if not gen_id or len(gen_id) > MAX_ID_LENGTH:
            await self._send_error(gen_id[:MAX_ID_LENGTH], invalid_request(
                f"Every message needs an id of 1 to {MAX_ID_LENGTH} characters.",
                code="invalid_id", param="id"))
            return
        if action == "cancel":
            self._cancel(gen_id)
            return
        if action not in ("generate", "resume"):
            await self._send_error(gen_id, invalid_request(
                "Set one of generate, cancel or resume.", code="invalid_message"))
            return
        try:
            self.principal = self.state.keys.check(self.digest)
        except ApiError as error:
            # The key was revoked or expired since the call began: the call ends.
            await self._send_error(gen_id, error)
            self._fail(error)
            return
        if gen_id in self.gens:
            await self._send_error(gen_id, invalid_request(
                "A generation with this id is still running.", code="duplicate_id",
                param="id"))
            return
        if self.state.draining:
            await self._send_error(gen_id, unavailable(
                "This edge is shutting down; retry on another.", code="edge_draining"))
            return
        limit = self.state.config.grpc.max_concurrent
        if len(self.gens) >= limit:
            await self._send_error(gen_id, ApiError(
                429, f"At most {limit} generations run at once on one Session.",
                type="rate_limit_error", code="too_many_concurrent"))
            return
        gen = Generation(gen_id)
        self.gens[gen_id] = gen
        if action == "resume":
            gen.resumed = msg.resume.request_id
            coro = self._resume(gen, msg.resume)
        else:
            coro = self._generation(gen, msg.generate)
        gen.task = asyncio.create_task(coro, name=f"tidegate-grpc-gen-{gen_id[:16]}")

    def _cancel(self, gen_id: str) -> None:
        gen = self.gens.get(gen_id)
        if gen is None or gen.cancel_requested:
            if gen is None:
                self._spawn(self._send_error(gen_id, invalid_request(
                    "No generation with this id is running.", code="unknown_id", param="id")))
            return
        gen.cancel_requested = True
        if gen.relay is not None:
            gen.relay.session.abort(cancel_error())
        elif gen.resumed:
            # A resumed stream runs elsewhere: cancel it as POST
            # /v1/streams/{id}/cancel does; its log then ends, and the replay
            # answers Cancelled.
            self._spawn(self._cancel_stream(gen.resumed))

    async def _cancel_stream(self, request_id: str) -> None:
        state = self.state
        try:
            await resume.cancel_stream(request_id, self.principal.tenant, state.sessions,
                                       state.streamlog, state.relay.publisher.tombstone)
        except ApiError as error:
            # The id is the client's (any text): quoted and cut, never a line of its own.
            log.info("gRPC cancel of resumed stream %.64r: %s", request_id, error.code)

    async def _on_relay(self, gen: Generation, relay: Relay) -> None:
        if gen.cancel_requested:
            relay.session.abort(cancel_error())

    async def _generation(self, gen: Generation, req: pb.GenerateRequest) -> None:
        """One generation, start to end. Never raises (but CancelledError)."""
        state = self.state
        api = CHAT.api
        with contextlib.suppress(ApiError):
            api = api_of(req)
        rt = instrument.RequestTelemetry(state.telemetry, self.metadata, api)
        if rt.span is not None:
            rt.span.set_attribute("tidegate.transport", "grpc")
        token = rt.activate()
        status = 200
        try:
            failure, _ = await run_generation(
                state, self.principal, req, self.metadata, self.sink, gen, rt,
                self.context.time_remaining(),
                on_relay=lambda r: self._on_relay(gen, r))
            if self.sink.slow:
                self._fail(unavailable("The client did not read for "
                                       f"{state.config.edge.slow_client_timeout:g}s.",
                                       code="slow_client"))
            elif failure is not None and failure.code in CANCEL_CODES:
                status = 499
                await self.sink.send(pb.GenerateResponse(id=gen.id, cancelled=pb.Cancelled()))
            elif failure is not None and failure.code != "edge_reconnect":
                rt.on_error(failure)
                status = failure.status
                await self.sink.send(error_message(gen.id, failure))
        except ApiError as error:
            rt.on_error(error)
            status = error.status
            await self._send_error(gen.id, error)
        except asyncio.CancelledError:
            rt.on_cancel("client_disconnected")
            raise
        except Exception:
            status = 500
            log.exception("gRPC Session generation %s failed", gen.id)
            await self._send_error(gen.id, ApiError(
                500, "Internal gateway error.", type="server_error", code="internal_error"))
        finally:
            rt.finish(status)
            instrument.deactivate(token)
            self.gens.pop(gen.id, None)
            self._maybe_end()

    async def _resume(self, gen: Generation, req: pb.Resume) -> None:
        """Replay a resumable stream from its log (the rules of GET
        /v1/streams/{request_id}: the caller's tenant only, 404 otherwise)."""
        try:
            async with self.state.streamlog.read(req.request_id, self.principal.tenant,
                                                 req.after) as reader:
                if not reader.open.stream:
                    raise ApiError(400, "This stream is a non-streaming request's; read its "
                                        "body with GET /v1/streams/{request_id}.",
                                   type="invalid_request_error", code="not_a_stream",
                                   param="request_id")
                await self._replay(gen, reader)
        except ApiError as error:
            await self._send_error(gen.id, error)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("gRPC Session resume %s failed", gen.id)
            await self._send_error(gen.id, ApiError(
                500, "Internal gateway error.", type="server_error", code="internal_error"))
        finally:
            self.gens.pop(gen.id, None)
            self._maybe_end()

    async def _replay(self, gen: Generation, reader: LogReader) -> None:
        send = self.sink.send
        gid = gen.id
        await send(pb.GenerateResponse(id=gid, accepted=pb.Accepted(
            request_id=reader.request_id, resumable=True)))
        while True:
            try:
                item = await reader.next_unless_draining(None)
            except StopAsyncIteration:
                return
            if isinstance(item, Draining):
                await send(pb.GenerateResponse(id=gid, reconnect=pb.Reconnect(
                    request_id=reader.request_id, after=reader.last_id)))
                return
            assert item is not None
            if isinstance(item, LogEvent):
                await send(pb.GenerateResponse(id=gid, chunk=pb.Chunk(data=item.data,
                                                                      seq=item.id)))
                continue
            if item.error is None:
                d = item.done
                usage = (pb.Usage(prompt_tokens=d.prompt_tokens,
                                  completion_tokens=d.completion_tokens,
                                  finish_reason=d.finish_reason) if d is not None
                         else pb.Usage())
                await send(pb.GenerateResponse(id=gid, done=pb.Done(usage=usage)))
            elif item.error.code in CANCEL_CODES:
                await send(pb.GenerateResponse(id=gid, cancelled=pb.Cancelled()))
            else:
                await send(error_message(gid, from_info(item.error)))
            return
