"""Backend for any OpenAI-compatible HTTP server: vLLM, Ollama, llama.cpp, TGI, OpenAI.

The worker forwards the client's body (``model`` replaced by the upstream name)
and relays the response byte for byte; only a few events are looked into, each
found by a byte search first: ``data: [DONE]`` ends the stream; a non-null
``usage`` is recorded (the worker always asks for it, and drops the usage-only
chunk the client did not ask for); a ``finish_reason`` is recorded; a top-level
``error`` becomes a :class:`BackendError`; comments are dropped.

Invariant: closing a stream early closes the TCP connection (never pooled), so
the backend aborts and frees its KV cache. HTTP goes through
``workers.backends.http1`` (:class:`OpenAIStream` is a push stream); error
mapping is ``workers.backends.upstream``. Docs: docs/backends.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from typing import Any

from tidegate import apis
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.config import ModelConfig, WorkerConfig
from tidegate.control.prices import PRICE_EXTRA
from tidegate.errors import BackendError, ConfigError
from tidegate.wire.protocol import Api, Request
from workers.backends import upstream
from workers.backends.base import Sink, Usage
from workers.backends.http1 import BodyTooLarge, Http1Pool, Response
from workers.backends.messages_sse import MessagesPassthrough, MessagesTranslator, finish_of
from workers.backends.messages_sse import record_usage as record_messages_usage
from workers.backends.messages_translate import to_chat, to_message
from workers.backends.responses_sse import ResponsesPassthrough, record_usage
from workers.backends.sse import SSEPassthrough, cached_tokens, loads
from workers.backends.upstream import endpoint_missing, status_error

__all__ = ["BodyStream", "OpenAIBackend", "OpenAIStream"]

log = logging.getLogger("tidegate.workers.backend")

ERROR_BODY_LIMIT = 64 << 10  # bytes of an upstream error body read for its message
# After [DONE] the chunked terminator normally follows at once; wait this long
# for it so the connection goes back to the pool, else close it.
_DRAIN_TIMEOUT = 0.5


class _Reader:
    """The sink behind :meth:`OpenAIStream.read`: one message per call."""

    __slots__ = ("done", "error", "got", "waiter", "want")

    def __init__(self) -> None:
        self.want = 0  # credit while a read() waits
        self.got: bytes | None = None
        self.done = False
        self.error: BackendError | None = None
        self.waiter: asyncio.Future[None] | None = None

    def credit(self) -> int:
        return self.want

    def data(self, data: bytes) -> None:
        self.got, self.want = data, 0
        self._wake()

    def end(self, error: BackendError | None) -> None:
        self.done, self.error = True, error
        self._wake()

    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


class OpenAIStream:
    """A streaming response being relayed. Implements ``PushStream``.

    Pushed: each socket read is decoded (HTTP framing, then
    :class:`SSEPassthrough`) in the connection's callback, and the complete
    events go to the sink at once, as many per message as its credit allows,
    cut at event boundaries (one event larger than the credit goes whole).
    With no credit, the rest of that read is kept and the socket is paused, so
    what the stream holds is bounded by one socket read and TCP pushes back on
    the backend.

    Silence limits (first_byte_timeout, then idle_timeout) are enforced by one
    watchdog timer per stream that wakes every quarter limit, not by a timeout
    per chunk. The price is precision: a silent backend is cut off between 1
    and 1.25 times the limit. Time paused for lack of credit is not silence.
    """

    def __init__(self, resp: Response,
                 parser: SSEPassthrough | ResponsesPassthrough | MessagesPassthrough
                 | MessagesTranslator, model: ModelConfig,
                 read_bytes: int) -> None:
        self._resp = resp
        self._parser = parser
        self._model = model
        self._read_bytes = read_bytes
        self._sink: Sink | None = None
        self._reader: _Reader | None = None
        self._pending = b""  # complete events waiting for credit
        self._paused = False  # socket paused for lack of credit
        self._body_done = False  # the HTTP body ended cleanly
        self._ended = False  # the sink was told the end, or the stream was closed
        self._loop = asyncio.get_running_loop()
        self._last_data = self._loop.time()
        self._watchdog = self._loop.call_later(self._limit()[1] / 4, self._check_silence)

    def _limit(self) -> tuple[str, float]:
        if self._parser.events:
            return "went silent mid-stream", self._model.idle_timeout
        return "sent no first event", self._model.first_byte_timeout

    def _check_silence(self) -> None:
        if self._ended:
            return
        what, limit = self._limit()
        if self._paused:
            self._last_data = self._loop.time()
        elif self._loop.time() - self._last_data >= limit:
            self._fail(upstream.timeout(self._model.name, what, limit))
            return
        self._watchdog = self._loop.call_later(limit / 4, self._check_silence)

    @property
    def usage(self) -> Usage:
        return self._parser.usage

    # -- push --------------------------------------------------------------

    def start(self, sink: Sink) -> None:
        """Deliver to ``sink`` from now on; call :meth:`resume` when its credit
        returns after it had none."""
        self._sink = sink
        self._resp.start(self._on_data, self._on_end)

    def resume(self) -> None:
        if self._ended:
            return
        self._forward()
        if self._paused and not self._pending and not self._ended:
            self._paused = False
            self._last_data = self._loop.time()
            self._resp.resume()

    def _on_data(self, data: bytes) -> None:
        if self._ended:
            return
        self._last_data = self._loop.time()
        try:
            out = self._parser.feed(data)
        except BackendError as exc:
            self._fail(exc)
            return
        if out:
            self._pending = self._pending + out if self._pending else out
        self._forward()

    def _on_end(self, exc: BaseException | None) -> None:
        if self._ended:
            return
        if exc is not None:
            self._fail(upstream.broken(self._model.name, f"connection broke mid-stream: {exc}"))
            return
        self._body_done = True
        try:
            out = self._parser.flush()
        except BackendError as error:
            self._fail(error)
            return
        if out:
            self._pending += out
        self._forward()

    def _forward(self) -> None:
        sink = self._sink
        assert sink is not None
        pending = self._pending
        while pending:
            credit = min(sink.credit(), self._read_bytes)
            if credit <= 0:
                self._pending = pending
                if not self._paused:
                    self._paused = True
                    self._resp.pause()
                return
            if len(pending) <= credit:
                part, pending = pending, b""
            else:
                cut = pending.rfind(b"\n\n", 0, credit)
                if cut < 0:  # one event larger than the credit goes whole
                    cut = pending.find(b"\n\n")
                part, pending = pending[:cut + 2], pending[cut + 2:]
            self._pending = pending
            sink.data(part)
            if self._ended:  # the sink closed the stream
                return
        if self._parser.done or self._body_done:
            self._finish()

    def _detach(self) -> None:
        """Ended: drop the sink (the job) so stream and job do not keep each
        other alive; every entry point checks ``_ended`` first."""
        self._sink = None
        self._reader = None

    def _finish(self) -> None:
        """Everything is forwarded and the stream is over: end it normally or,
        for a body that ended without [DONE] or a finish reason, as broken."""
        if not self._parser.done and not self._parser.finish_reason:
            self._fail(upstream.broken(self._model.name,
                                       "closed the stream early (no [DONE], no finish_reason)"))
            return
        self._ended = True
        self._watchdog.cancel()
        if not self._body_done:
            self._resp.finish(_DRAIN_TIMEOUT)  # [DONE] seen: reuse the connection if it ends
        sink = self._sink
        assert sink is not None
        sink.end(None)
        self._detach_later(sink)

    def _fail(self, error: BackendError) -> None:
        self._ended = True
        self._watchdog.cancel()
        self._resp.abort()
        sink = self._sink
        if sink is not None:
            sink.end(error)
            self._detach_later(sink)

    def _detach_later(self, sink: Sink) -> None:
        # A read() in progress still needs its reader after end(): keep it.
        if sink is not self._reader:
            self._detach()

    async def aclose(self) -> None:
        """Close the upstream connection at once (aborts the generation). Idempotent."""
        if not self._ended:
            self._ended = True
            self._watchdog.cancel()
            self._resp.abort()
        if self._reader is None:
            self._detach()

    # -- pull ------------------------------------------------------------------

    async def read(self, max_bytes: int) -> bytes:
        reader = self._reader
        if reader is None:
            reader = self._reader = _Reader()
            self.start(reader)
        while reader.got is None and not reader.done:
            if self._ended:  # closed by aclose()
                return b""
            reader.want = max(1, max_bytes)
            reader.waiter = self._loop.create_future()
            self.resume()
            if reader.got is None and not reader.done:
                await reader.waiter
        if reader.got is not None:
            data, reader.got = reader.got, None
            return data
        if reader.error is not None:
            raise reader.error
        return b""


class BodyStream:
    """A complete non-streaming body, handed out in ``max_bytes`` slices."""

    def __init__(self, body: bytes, usage: Usage) -> None:
        self._body = body
        self._offset = 0
        self._usage = usage

    @property
    def usage(self) -> Usage:
        return self._usage

    async def read(self, max_bytes: int) -> bytes:
        start = self._offset
        self._offset = min(len(self._body), start + max(1, max_bytes))
        return self._body[start:self._offset]

    async def aclose(self) -> None:
        self._offset = len(self._body)


class OpenAIBackend:
    """Implements ``Backend`` for one model on an OpenAI-compatible server.

    One keep-alive pool (:class:`~workers.backends.http1.Http1Pool`) per
    instance, created on first use inside the running loop, closed by
    :meth:`aclose`.
    """

    def __init__(self, model: ModelConfig, worker: WorkerConfig) -> None:
        self._model = model
        self._worker = worker
        self._pool: Http1Pool | None = None
        # /v1/messages: relayed to the backend's own (True), translated to
        # chat (False), or not known yet ("auto" until the first answer).
        self._native: bool | None = {"passthrough": True, "translate": False}.get(
            model.messages)
        self._anthropic_auth = b""
        auth = ""
        if model.api_key_env:
            key = os.environ.get(model.api_key_env, "")
            if not key:
                raise ConfigError(f"model {model.name!r}: api_key_env names "
                                  f"{model.api_key_env!r}, which is not set")
            if not _header_safe(key):
                raise ConfigError(f"model {model.name!r}: the key in {model.api_key_env!r} "
                                  f"holds characters an HTTP header cannot carry")
            auth = f"Authorization: Bearer {key}\r\n"
            self._anthropic_auth = f"x-api-key: {key}\r\n".encode("latin-1")
        common = ("Content-Type: application/json\r\nAccept-Encoding: identity\r\n"
                  f"User-Agent: tidegate\r\n{auth}")
        self._base_headers = {
            True: (common + "Accept: text/event-stream\r\n").encode("latin-1"),
            False: (common + "Accept: application/json\r\n").encode("latin-1")}

    def _http(self) -> Http1Pool:
        if self._pool is None:
            self._pool = Http1Pool(self._model.base_url,
                                   connect_timeout=self._model.connect_timeout)
        return self._pool

    def _payload(self, request: Request) -> bytes:
        body = dict(request.body)
        body["model"] = self._model.backend_model
        if not apis.of(request.api).usage_asked:
            # Responses and embeddings go as the client sent them, model aside:
            # Responses streams report usage in response.completed unasked.
            # Background mode is tidegate's (edge.background): the backend
            # answers in the foreground, into the stream log.
            body.pop("background", None)
            return json.dumps(body, separators=(",", ":")).encode()
        body["stream"] = request.stream
        if request.stream:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                      "include_usage": True}
        else:
            body.pop("stream_options", None)  # OpenAI rejects it without stream
        return json.dumps(body, separators=(",", ":")).encode()

    def _headers(self, request: Request, native: bool = False) -> bytes:
        headers = self._base_headers[request.stream]
        # A native /v1/messages also gets the client's anthropic-version and
        # anthropic-beta (edge: extra["anthropic"]), unchanged, and the key
        # as Anthropic's own API wants it.
        forwarded = request.extra.get("anthropic") if native else None
        names = ("traceparent", "tracestate")
        for name, value in [*((n, request.extra.get(n)) for n in names),
                            *(forwarded.items() if isinstance(forwarded, dict) else ())]:
            if isinstance(value, str) and value and _header_safe(value) and _header_safe(name):
                headers += f"{name}: {value}\r\n".encode("latin-1")
        return headers + self._anthropic_auth if native else headers

    async def _post(self, path: str, headers: bytes, payload: bytes, api: Api) -> Response:
        model = self._model
        limit = model.connect_timeout + model.first_byte_timeout
        try:
            async with asyncio.timeout(limit):
                resp = await self._http().request("POST", path, headers, payload)
        except TimeoutError:
            raise upstream.timeout(model.name, "sent no response headers", limit) from None
        except OSError as exc:  # refused, connect timeout, closed, not HTTP
            raise upstream.unavailable(model.name, exc) from exc
        if not 200 <= resp.status < 300:
            raise await self._status_error(resp, api)
        return resp

    async def open(self, request: Request) -> OpenAIStream | BodyStream:
        dialect = apis.of(request.api)
        if dialect.anthropic:
            return await self._messages(request)
        model = self._model
        resp = await self._post(dialect.path, self._headers(request),
                                self._payload(request), request.api)
        prompt_tokens = dialect.prompt_tokens(request.body)
        if not request.stream:
            return await self._body(resp, request, prompt_tokens)
        if dialect.typed_events:  # Responses
            # Its own parser, chosen once per job: chat's tuned path stays as it is.
            rename = ("resp_" + request.id).encode() if request.extra.get("background") \
                or request.body.get("background") is True else None
            return OpenAIStream(resp, ResponsesPassthrough(prompt_tokens=prompt_tokens,
                                                           model=model.name, rename=rename),
                                model, self._worker.read_bytes)
        options = request.body.get("stream_options")
        include_usage = request.include_usage or (
            isinstance(options, dict) and bool(options.get("include_usage")))
        parser = SSEPassthrough(include_usage=include_usage, prompt_tokens=prompt_tokens,
                                model=model.name, cost=request.extra.get(PRICE_EXTRA))
        return OpenAIStream(resp, parser, model, self._worker.read_bytes)

    async def _status_error(self, resp: Response, api: Api) -> BackendError:
        raw = b""
        try:
            async with asyncio.timeout(min(self._model.idle_timeout, 10.0)):
                raw = await resp.read_all(ERROR_BODY_LIMIT, truncate=True)
        except (TimeoutError, OSError):
            pass  # the status alone still tells what happened
        finally:
            resp.abort()
        log.info("model backend %s answered HTTP %d", self._model.name, resp.status)
        message = upstream.upstream_message(raw)
        dialect = apis.of(api)
        if resp.status == 529 or (resp.status == 503 and dialect.anthropic):
            # Overloaded (529 is Anthropic's own): 503, which a Messages
            # client reads as 529 overloaded_error (tidegate.wire.anthropic).
            return BackendError(503, f"The model backend for {self._model.name!r} is "
                                f"overloaded (HTTP {resp.status}): {message}",
                                type="service_unavailable", code="backend_overloaded",
                                retryable=True,
                                retry_after=upstream.retry_after(resp.headers) or 1.0)
        if dialect.optional_endpoint and upstream.is_missing_endpoint(resp.status, message):
            log.warning("model backend %s (%s) does not serve %s", self._model.name,
                        self._model.base_url, dialect.path)
            return endpoint_missing(self._model.name, "/v1" + dialect.path, resp.status,
                                    message)
        return status_error(resp.status, upstream.upstream_message(raw),
                            model=self._model.name,
                            retry_after=upstream.retry_after(resp.headers))

    async def _messages(self, request: Request) -> OpenAIStream | BodyStream:
        """POST /v1/messages: relayed to the backend's own endpoint or
        translated to chat (``ModelConfig.messages``; "auto" learns which from
        the first answer and keeps it for the life of this backend)."""
        model = self._model
        messages = apis.of(request.api)
        prompt_tokens = messages.prompt_tokens(request.body)
        if self._native is not False:
            try:
                resp = await self._post(messages.path, self._headers(request, native=True),
                                        self._payload(request), request.api)
            except BackendError as exc:
                if self._native is not None or exc.code != "endpoint_not_supported":
                    raise
                log.info("model backend %s serves no /v1/messages: translating to chat",
                         model.name)
                self._native = False
            else:
                self._native = True
                if not request.stream:
                    raw, obj = await self._read_json(resp)
                    usage = Usage(prompt_tokens=prompt_tokens, finish_reason=finish_of(
                        obj.get("stop_reason")))
                    record_messages_usage(usage, obj.get("usage"), final=True)
                    return BodyStream(raw, usage)
                return OpenAIStream(resp, MessagesPassthrough(
                    prompt_tokens=prompt_tokens, model=model.name,
                    message_id="msg_" + request.id,
                    client_model=str(request.body.get("model", model.name))),
                    model, self._worker.read_bytes)
        chat = to_chat(request.body, model.backend_model, stream=request.stream)
        resp = await self._post(CHAT.path, self._headers(request),
                                json.dumps(chat, separators=(",", ":")).encode(), CHAT.api)
        message_id = "msg_" + request.id
        client_model = str(request.body.get("model", model.name))
        if not request.stream:
            _, obj = await self._read_json(resp)
            usage = _body_usage(obj, CHAT.api, prompt_tokens)
            message = to_message(obj, message_id, client_model)
            return BodyStream(json.dumps(message, separators=(",", ":")).encode(), usage)
        return OpenAIStream(resp, MessagesTranslator(
            prompt_tokens=prompt_tokens, model=model.name, message_id=message_id,
            client_model=client_model), model, self._worker.read_bytes)

    async def _body(self, resp: Response, request: Request, prompt_tokens: int) -> BodyStream:
        body, obj = await self._read_json(resp)
        return BodyStream(body, _body_usage(obj, request.api, prompt_tokens))

    async def _read_json(self, resp: Response) -> tuple[bytes, dict[str, Any]]:
        """A complete non-streaming body and its JSON object."""
        model, cap = self._model, self._worker.max_response_bytes
        try:
            async with asyncio.timeout(model.idle_timeout):
                body = await resp.read_all(cap)
        except TimeoutError:
            raise upstream.timeout(model.name, "went silent while sending its response",
                                   model.idle_timeout) from None
        except BodyTooLarge:
            raise upstream.broken(model.name, f"sent a response larger than "
                                  f"worker.max_response_bytes ({cap} bytes)") from None
        except OSError as exc:
            raise upstream.broken(model.name, f"connection broke while sending its response: "
                                  f"{exc}") from exc
        obj = loads(body)
        if not isinstance(obj, dict):
            raise upstream.broken(model.name,
                                  "returned a response body that is not a JSON object")
        if obj.get("error") is not None and obj.get("type") != "message":
            raise upstream.broken(model.name,
                                  f"reported an error: {upstream.upstream_message(body)}")
        return body, obj

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            pool.close()


def _header_safe(value: str) -> bool:
    """Whether ``value`` can be sent as a header value as it is (no line
    breaks to inject headers with, nothing outside latin-1)."""
    if not value.isprintable():
        return False
    try:
        value.encode("latin-1")  # in C, not a Python loop per character
    except UnicodeEncodeError:
        return False
    return True


def _body_usage(obj: dict[str, Any], api: Api, prompt_tokens: int) -> Usage:
    """Usage and finish reason of a non-streaming body; estimated when not reported."""
    usage = Usage(prompt_tokens=prompt_tokens)
    dialect = apis.of(api)
    if dialect.typed_events:  # Responses (Messages has its own path)
        status = obj.get("status")
        usage.finish_reason = "stop" if status == "completed" else str(status or "")
        record_usage(usage, obj)
        return usage
    if dialect.vectors:
        reported = obj.get("usage")
        if isinstance(reported, dict) and isinstance(reported.get("prompt_tokens"), int):
            usage.prompt_tokens = reported["prompt_tokens"]
        usage.finish_reason = "stop"
        return usage
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else {}
    if isinstance(first, dict):
        if isinstance(first.get("finish_reason"), str):
            usage.finish_reason = first["finish_reason"]
        message = first.get("message")
        text = (message.get("content") if isinstance(message, dict) else None
                ) if dialect.openai_chat else first.get("text")
        if isinstance(text, str):
            usage.completion_tokens = (len(text) + 3) // 4
    reported = obj.get("usage")
    if isinstance(reported, dict):
        if isinstance(reported.get("prompt_tokens"), int):
            usage.prompt_tokens = reported["prompt_tokens"]
        if isinstance(reported.get("completion_tokens"), int):
            usage.completion_tokens = reported["completion_tokens"]
        usage.cached_tokens = cached_tokens(reported, "prompt_tokens_details")
    return usage
