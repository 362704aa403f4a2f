"""Backend for any OpenAI-compatible HTTP server: vLLM, Ollama, llama.cpp, TGI, OpenAI.

The worker forwards the client's body (with ``model`` replaced by the upstream
name) and relays the response **byte for byte**: SSE events are passed through
as the backend wrote them, never re-serialised. Only a few events are looked
into, each found by a cheap byte search before any JSON is parsed:

* ``data: [DONE]`` ends the stream (the edge writes its own).
* An event with a non-null ``usage`` records the token usage. The worker always
  asks the backend for usage (``stream_options.include_usage``) because quota
  reconciliation needs it; when the client did not ask for it, the usage-only
  chunk (empty ``choices``) is dropped. The other chunks then carry
  ``"usage": null``, which clients accept, and they are left untouched.
* An event with a non-null ``finish_reason`` records it.
* An event with a top-level ``error`` becomes a :class:`BackendError`.
* SSE comments and non-``data`` lines are dropped; the edge sends its own pings.

Closing a stream early closes the TCP connection (``resp.close()``, not
``release()``): that is how vLLM and friends learn the client left and abort
the generation, freeing its KV cache.

Errors map to HTTP statuses as ``workers.backends.upstream`` lists; the
SSE handling is ``workers.backends.sse``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from typing import Any

import aiohttp

from tidegate.config import ModelConfig, WorkerConfig
from tidegate.errors import BackendError, ConfigError
from tidegate.protocol import Api, Request
from tidegate.tokens import estimate_prompt_tokens
from workers.backends import Usage, upstream
from workers.backends.sse import SSEPassthrough, loads
from workers.backends.upstream import status_error

__all__ = ["BodyStream", "OpenAIBackend", "OpenAIStream"]

log = logging.getLogger("tidegate.workers.backend")

ERROR_BODY_LIMIT = 64 << 10  # bytes of an upstream error body read for its message
# Below uvicorn's default 5 s keep-alive (vLLM), so an idle pooled connection is
# never reused just as the server closes it.
_KEEPALIVE = 4.0
# After [DONE] the chunked terminator normally follows at once; wait this long
# for it so the connection goes back to the pool, else close it.
_DRAIN_TIMEOUT = 0.05

class OpenAIStream:
    """A streaming response being relayed. Implements ``BackendStream``.

    ``read`` reads at most ``min(max_bytes, worker.read_bytes)`` bytes per
    upstream read and reads again only when no complete event is buffered, so
    what it holds is bounded by one event plus one read. While the worker does
    not call ``read``, nothing is read and TCP pushes back on the backend.

    Silence limits (first_byte_timeout, then idle_timeout) are enforced by one
    watchdog timer per stream that wakes every quarter limit, not by a timeout
    scope per read: reads are per chunk, the hot path, and arming a timer for
    each cost about 8% of a worker's CPU. The price is precision: a silent
    backend is cut off between 1 and 1.25 times the limit.
    """

    def __init__(self, resp: aiohttp.ClientResponse, parser: SSEPassthrough,
                 model: ModelConfig, read_bytes: int) -> None:
        self._resp = resp
        self._parser = parser
        self._model = model
        self._read_bytes = read_bytes
        self._ended = False
        self._loop = asyncio.get_running_loop()
        self._last_data = self._loop.time()
        self._silent: tuple[str, float] | None = None  # set when the watchdog fired
        self._watchdog = self._loop.call_later(self._limit()[1] / 4, self._check_silence)

    def _limit(self) -> tuple[str, float]:
        if self._parser.events:
            return "went silent mid-stream", self._model.idle_timeout
        return "sent no first event", self._model.first_byte_timeout

    def _check_silence(self) -> None:
        what, limit = self._limit()
        if self._ended:
            return
        if self._loop.time() - self._last_data >= limit:
            # Closing the response makes the pending read fail; read() then
            # reports the timeout rather than a broken connection.
            self._silent = (what, limit)
            self._abort()
            return
        self._watchdog = self._loop.call_later(limit / 4, self._check_silence)

    @property
    def usage(self) -> Usage:
        return self._parser.usage

    async def read(self, max_bytes: int) -> bytes:
        if self._ended:
            return b""
        parser = self._parser
        n = max(1, min(max_bytes, self._read_bytes))
        while True:
            try:
                data = await self._resp.content.read(n)
            except aiohttp.ClientError as exc:
                self._abort()
                if self._silent is not None:
                    raise upstream.timeout(self._model.name, *self._silent) from None
                raise upstream.broken(self._model.name,
                              f"connection broke mid-stream: {exc}") from exc
            if self._silent is not None:
                raise upstream.timeout(self._model.name, *self._silent)
            self._last_data = self._loop.time()
            try:
                out = parser.feed(data) if data else parser.flush()
            except BackendError:
                self._abort()
                raise
            if parser.done:
                await self._finish()
                return out
            if not data:
                if not parser.finish_reason:
                    self._abort()
                    raise upstream.broken(self._model.name,
                                  "closed the stream early (no [DONE], no finish_reason)")
                await self._finish()
                return out
            if out:
                return out

    async def _finish(self) -> None:
        """Normal end: hand the connection back to the pool if the body is complete."""
        self._ended = True
        self._watchdog.cancel()
        resp = self._resp
        try:
            async with asyncio.timeout(_DRAIN_TIMEOUT):
                while await resp.content.read(ERROR_BODY_LIMIT):
                    pass
        except (TimeoutError, aiohttp.ClientError):
            resp.close()
            return
        resp.release()

    def _abort(self) -> None:
        self._ended = True
        self._watchdog.cancel()
        _shutdown_now(self._resp)
        self._resp.close()

    async def aclose(self) -> None:
        """Close the upstream connection at once (aborts the generation). Idempotent."""
        if not self._ended:
            self._abort()
        self._resp.close()


def _shutdown_now(resp: aiohttp.ClientResponse) -> None:
    """Send the backend our FIN now. ``resp.close()`` closes the socket only
    after the rest of this event-loop iteration has run, and a loaded worker's
    iteration is long: every other job woken with it relays its chunks, and
    every other cancelled job runs its cancel handling (log line, metrics,
    usage record) first. shutdown() acts at once, on a duplicate of the
    descriptor (transport sockets refuse shutdown()); the transport still
    closes the socket itself."""
    connection = resp.connection
    transport = connection.transport if connection is not None else None
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return
    try:
        dup = socket.socket(fileno=os.dup(sock.fileno()))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer
    finally:
        dup.close()


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

    One pooled :class:`aiohttp.ClientSession` per instance, created on first
    use inside the running loop, sized for ``model.max_streams`` concurrent
    streams, closed by :meth:`aclose`.
    """

    def __init__(self, model: ModelConfig, worker: WorkerConfig) -> None:
        self._model = model
        self._worker = worker
        self._http: aiohttp.ClientSession | None = None
        base = model.base_url.rstrip("/")
        self._urls = {Api.CHAT: base + "/chat/completions", Api.COMPLETIONS: base + "/completions"}
        self._auth = ""
        if model.api_key_env:
            key = os.environ.get(model.api_key_env, "")
            if not key:
                raise ConfigError(f"model {model.name!r}: api_key_env names "
                                  f"{model.api_key_env!r}, which is not set")
            self._auth = f"Bearer {key}"

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            connector = aiohttp.TCPConnector(limit=max(1, self._model.max_streams),
                                             keepalive_timeout=_KEEPALIVE)
            # Only the socket connect has its own limit; the time to response
            # headers and between reads is bounded per call, in open()/read().
            timeout = aiohttp.ClientTimeout(total=None,
                                            sock_connect=self._model.connect_timeout)
            self._http = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self._http

    def _payload(self, request: Request) -> bytes:
        body = dict(request.body)
        body["model"] = self._model.backend_model
        body["stream"] = request.stream
        if request.stream:
            options = body.get("stream_options")
            body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                      "include_usage": True}
        else:
            body.pop("stream_options", None)  # OpenAI rejects it without stream
        return json.dumps(body, separators=(",", ":")).encode()

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {"Content-Type": "application/json",
                   "Accept": "text/event-stream" if request.stream else "application/json"}
        if self._auth:
            headers["Authorization"] = self._auth
        for name in ("traceparent", "tracestate"):
            value = request.extra.get(name)
            if isinstance(value, str) and value:
                headers[name] = value
        return headers

    async def open(self, request: Request) -> OpenAIStream | BodyStream:
        model = self._model
        limit = model.connect_timeout + model.first_byte_timeout
        try:
            async with asyncio.timeout(limit):
                resp = await self._session().post(
                    self._urls[request.api], data=self._payload(request),
                    headers=self._headers(request), allow_redirects=False)
        except aiohttp.ConnectionTimeoutError as exc:
            raise upstream.unavailable(model.name, exc) from exc
        except TimeoutError:
            raise upstream.timeout(model.name, "sent no response headers", limit) from None
        except aiohttp.ClientError as exc:
            raise upstream.unavailable(model.name, exc) from exc
        except OSError as exc:
            raise upstream.unavailable(model.name, exc) from exc
        if not 200 <= resp.status < 300:
            raise await self._status_error(resp)
        prompt_tokens = estimate_prompt_tokens(request.api, request.body)
        if not request.stream:
            return await self._body(resp, request, prompt_tokens)
        options = request.body.get("stream_options")
        include_usage = request.include_usage or (
            isinstance(options, dict) and bool(options.get("include_usage")))
        parser = SSEPassthrough(include_usage=include_usage, prompt_tokens=prompt_tokens,
                                model=model.name)
        return OpenAIStream(resp, parser, model, self._worker.read_bytes)

    async def _status_error(self, resp: aiohttp.ClientResponse) -> BackendError:
        raw = b""
        try:
            async with asyncio.timeout(min(self._model.idle_timeout, 10.0)):
                while len(raw) < ERROR_BODY_LIMIT:
                    data = await resp.content.read(ERROR_BODY_LIMIT - len(raw))
                    if not data:
                        break
                    raw += data
        except (TimeoutError, aiohttp.ClientError):
            pass  # the status alone still tells what happened
        finally:
            resp.close()
        log.info("model backend %s answered HTTP %d", self._model.name, resp.status)
        return status_error(resp.status, upstream.upstream_message(raw),
                            model=self._model.name,
                            retry_after=upstream.retry_after(resp.headers))

    async def _body(self, resp: aiohttp.ClientResponse, request: Request,
                    prompt_tokens: int) -> BodyStream:
        model, cap = self._model, self._worker.max_response_bytes
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                async with asyncio.timeout(model.idle_timeout):
                    data = await resp.content.read(self._worker.read_bytes)
                if not data:
                    break
                size += len(data)
                if size > cap:
                    raise upstream.broken(model.name, f"sent a response larger than "
                                  f"worker.max_response_bytes ({cap} bytes)")
                parts.append(data)
        except TimeoutError:
            resp.close()
            raise upstream.timeout(model.name, "went silent while sending its response",
                           model.idle_timeout) from None
        except aiohttp.ClientError as exc:
            resp.close()
            raise upstream.broken(model.name, f"connection broke while sending its response: "
                          f"{exc}") from exc
        except BackendError:
            resp.close()
            raise
        resp.release()
        body = b"".join(parts)
        obj = loads(body)
        if not isinstance(obj, dict):
            raise upstream.broken(model.name,
                                  "returned a response body that is not a JSON object")
        if obj.get("error") is not None:
            raise upstream.broken(model.name,
                                  f"reported an error: {upstream.upstream_message(body)}")
        return BodyStream(body, _body_usage(obj, request.api, prompt_tokens))

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()


def _body_usage(obj: dict[str, Any], api: Api, prompt_tokens: int) -> Usage:
    """Usage and finish reason of a non-streaming body; estimated when not reported."""
    usage = Usage(prompt_tokens=prompt_tokens)
    choices = obj.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else {}
    if isinstance(first, dict):
        if isinstance(first.get("finish_reason"), str):
            usage.finish_reason = first["finish_reason"]
        message = first.get("message")
        text = (message.get("content") if isinstance(message, dict) else None
                ) if api == Api.CHAT else first.get("text")
        if isinstance(text, str):
            usage.completion_tokens = (len(text) + 3) // 4
    reported = obj.get("usage")
    if isinstance(reported, dict):
        if isinstance(reported.get("prompt_tokens"), int):
            usage.prompt_tokens = reported["prompt_tokens"]
        if isinstance(reported.get("completion_tokens"), int):
            usage.completion_tokens = reported["completion_tokens"]
    return usage
