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

Error mapping (all raise :class:`tidegate.errors.BackendError`; before the
first byte from :meth:`OpenAIBackend.open`, so the edge answers with the HTTP
status):

=====================  =====  ===========================  =========
upstream               HTTP   type / code                  retryable
=====================  =====  ===========================  =========
400, 404, 413, 422     400    invalid_request_error        no
401, 403               502    backend_auth_failed          no
429                    429    rate_limit_error             yes
503                    502    backend_error                yes
other 5xx / non-2xx    502    backend_error                no
connect failure        502    backend_unavailable          yes
no headers in time     504    backend_timeout              no
silence mid-stream     504    backend_timeout              no
=====================  =====  ===========================  =========
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import socket
from typing import Any

import aiohttp

from tidegate.config import ModelConfig, WorkerConfig
from tidegate.errors import BackendError, ConfigError
from tidegate.protocol import Api, Request
from tidegate.tokens import estimate_prompt_tokens
from workers.backends import Usage

__all__ = ["BodyStream", "OpenAIBackend", "OpenAIStream", "SSEPassthrough", "status_error"]

log = logging.getLogger("tidegate.workers.backend")

ERROR_BODY_LIMIT = 64 << 10  # bytes of an upstream error body read for its message
_MESSAGE_LIMIT = 1000  # characters of an upstream message quoted to the client
# Below uvicorn's default 5 s keep-alive (vLLM), so an idle pooled connection is
# never reused just as the server closes it.
_KEEPALIVE = 4.0
# After [DONE] the chunked terminator normally follows at once; wait this long
# for it so the connection goes back to the pool, else close it.
_DRAIN_TIMEOUT = 0.05

# One search finds every event worth parsing; most events match none of it.
_INTEREST_RE = re.compile(rb'"(?:usage"\s*:\s*\{|finish_reason"\s*:\s*"|error")')
_USAGE_RE = re.compile(rb'"usage"\s*:\s*\{')
_FINISH_RE = re.compile(rb'"finish_reason"\s*:\s*"')
_CONTENT_RE = re.compile(rb'"(?:content|text)"\s*:\s*"[^"]')


def _upstream_message(raw: bytes) -> str:
    """The message of an OpenAI-style (or FastAPI/TGI-style, or plain text) error body."""
    text = raw.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except ValueError:
        obj = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and err.get("message"):
            text = str(err["message"])
        elif isinstance(err, str) and err:
            text = err
        elif obj.get("detail"):
            text = str(obj["detail"])
        elif obj.get("message"):
            text = str(obj["message"])
    text = " ".join(text.split())
    if len(text) > _MESSAGE_LIMIT:
        text = text[:_MESSAGE_LIMIT] + "..."
    return text or "(empty response body)"


def status_error(status: int, message: str, *, model: str,
                 retry_after: float = 0.0) -> BackendError:
    """Map an upstream HTTP error status to the error the client sees."""
    if status in (400, 404, 413, 422):
        return BackendError(400, f"The model backend rejected the request (HTTP {status}): "
                            f"{message}", type="invalid_request_error", code="invalid_request")
    if status in (401, 403):
        return BackendError(502, f"The model backend for {model!r} refused the gateway's "
                            f"credentials (HTTP {status}): {message}", type="server_error",
                            code="backend_auth_failed")
    if status == 429:
        return BackendError(429, f"The model backend for {model!r} is rate limiting "
                            f"(HTTP 429): {message}", type="rate_limit_error",
                            code="backend_rate_limited", retryable=True,
                            retry_after=retry_after or 1.0)
    return BackendError(502, f"The model backend for {model!r} failed (HTTP {status}): "
                        f"{message}", type="server_error", code="backend_error",
                        retryable=status == 503, retry_after=retry_after)


def _unavailable(model: str, exc: BaseException) -> BackendError:
    return BackendError(502, f"The model backend for {model!r} is unreachable: "
                        f"{str(exc) or type(exc).__name__}", type="server_error",
                        code="backend_unavailable", retryable=True, retry_after=1.0)


def _timeout(model: str, what: str, seconds: float) -> BackendError:
    return BackendError(504, f"The model backend for {model!r} {what} within {seconds:g} s",
                        type="server_error", code="backend_timeout")


def _broken(model: str, what: str) -> BackendError:
    return BackendError(502, f"The model backend for {model!r} {what}", type="server_error",
                        code="backend_error")


def _retry_after(headers: Any) -> float:
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except ValueError:
        return 0.0


class SSEPassthrough:
    """Sans-I/O: upstream SSE bytes in, client-ready SSE bytes out, usage noted.

    Invariants: output is only complete events, each the upstream's own
    ``data:`` line(s) plus ``\\n\\n``; JSON is parsed only for the rare events
    that carry usage, a finish reason or an error. ``\\r\\n`` and lone ``\\r``
    line ends are normalised only when the input holds a ``\\r``.
    """

    __slots__ = ("_buf", "_include_usage", "_model", "done", "events", "usage",
                 "usage_reported")

    def __init__(self, *, include_usage: bool, prompt_tokens: int, model: str) -> None:
        self._buf = b""
        self._include_usage = include_usage
        self._model = model
        self.done = False  # data: [DONE] seen; later bytes are ignored
        self.events = 0  # data events seen (any), to tell "first byte" from "idle"
        self.usage = Usage(prompt_tokens=prompt_tokens)
        self.usage_reported = False

    @property
    def finish_reason(self) -> str:
        return self.usage.finish_reason

    def feed(self, data: bytes) -> bytes:
        """Take upstream bytes; return the complete events to pass on (maybe ``b""``)."""
        if self.done:
            return b""
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            tail = b"\r" if buf.endswith(b"\r") else b""  # may be half of a \r\n
            buf = buf[: len(buf) - len(tail)].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            buf += tail
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._buf = buf
            return b""
        # Fast path, nearly every read of a healthy stream: whole single-line
        # data events (the only newlines are the separators), none of them
        # [DONE] or of interest (usage, a finish reason, an error). They pass
        # as the input slice, scanned once per read instead of once per event.
        block = buf[:end + 2]
        n = block.count(b"\n\n")
        if (block.count(b"\n") == 2 * n and block.startswith(b"data:")
                and block.count(b"\n\ndata:") == n - 1 and b"[DONE]" not in block
                and _INTEREST_RE.search(block) is None):
            self._buf = buf[end + 2:]
            self.events += n
            if not self.usage_reported:
                if n == 1:
                    self.usage.completion_tokens += _CONTENT_RE.search(block) is not None
                else:
                    self.usage.completion_tokens += sum(
                        1 for event in block.split(b"\n\n") if _CONTENT_RE.search(event))
            return block
        *events, rest = buf.split(b"\n\n")
        self._buf = rest
        kept: list[bytes] = []
        intact = True  # every event passes unchanged: hand back the input slice as is
        for event in events:
            passed = self._event(event)
            if passed is None:
                intact = False
            else:
                intact = intact and passed is event
                kept.append(passed)
            if self.done:
                intact = False
                self._buf = b""
                break
        if intact:
            return buf[: len(buf) - len(rest)]
        return b"\n\n".join(kept) + b"\n\n" if kept else b""

    def flush(self) -> bytes:
        """End of input: treat an unterminated last event as complete (lenient)."""
        rest, self._buf = self._buf.rstrip(b"\r\n"), b""
        if not rest or self.done:
            return b""
        passed = self._event(rest)
        return passed + b"\n\n" if passed else b""

    def _event(self, event: bytes) -> bytes | None:
        """One event without its blank line: ``event`` itself when it passes
        unchanged, its ``data:`` lines when other lines were dropped, or None."""
        if event.startswith(b"data:") and b"\n" not in event:
            payload = event[6:] if event[5:6] == b" " else event[5:]
            out = event
        else:
            lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
            if not lines:
                return None  # comment, event:/id:/retry: only, or blank
            payload = b"\n".join(ln[6:] if ln[5:6] == b" " else ln[5:] for ln in lines)
            out = b"\n".join(lines)
        self.events += 1
        if payload == b"[DONE]":
            self.done = True
            return None
        if _INTEREST_RE.search(payload) is not None and not self._inspect(payload):
            return None
        if not self.usage_reported and _CONTENT_RE.search(payload):
            self.usage.completion_tokens += 1
        return out

    def _inspect(self, payload: bytes) -> bool:
        """The rare events: parse once, note usage / finish reason, raise on error.

        Returns whether the event goes to the client.
        """
        keep = True
        obj: Any = None
        if b'"error"' in payload:
            obj = _loads(payload)
            if isinstance(obj, dict) and obj.get("error") is not None:
                message = _upstream_message(payload)
                raise _broken(self._model, f"reported an error mid-stream: {message}")
        if _USAGE_RE.search(payload):
            obj = obj if obj is not None else _loads(payload)
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self._record_usage(obj["usage"])
                keep = obj.get("choices") != [] or self._include_usage
        if _FINISH_RE.search(payload):
            obj = obj if obj is not None else _loads(payload)
            if isinstance(obj, dict):
                for choice in obj.get("choices") or ():
                    if isinstance(choice, dict) and isinstance(choice.get("finish_reason"), str):
                        self.usage.finish_reason = choice["finish_reason"]
                        break
        return keep

    def _record_usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(completion, int):
            self.usage.completion_tokens = completion
            self.usage_reported = True
        if isinstance(prompt, int):
            self.usage.prompt_tokens = prompt


def _loads(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return None


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
                    raise _timeout(self._model.name, *self._silent) from None
                raise _broken(self._model.name,
                              f"connection broke mid-stream: {exc}") from exc
            if self._silent is not None:
                raise _timeout(self._model.name, *self._silent)
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
                    raise _broken(self._model.name,
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
            raise _unavailable(model.name, exc) from exc
        except TimeoutError:
            raise _timeout(model.name, "sent no response headers", limit) from None
        except aiohttp.ClientError as exc:
            raise _unavailable(model.name, exc) from exc
        except OSError as exc:
            raise _unavailable(model.name, exc) from exc
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
        return status_error(resp.status, _upstream_message(raw), model=self._model.name,
                            retry_after=_retry_after(resp.headers))

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
                    raise _broken(model.name, f"sent a response larger than "
                                  f"worker.max_response_bytes ({cap} bytes)")
                parts.append(data)
        except TimeoutError:
            resp.close()
            raise _timeout(model.name, "went silent while sending its response",
                           model.idle_timeout) from None
        except aiohttp.ClientError as exc:
            resp.close()
            raise _broken(model.name, f"connection broke while sending its response: "
                          f"{exc}") from exc
        except BackendError:
            resp.close()
            raise
        resp.release()
        body = b"".join(parts)
        obj = _loads(body)
        if not isinstance(obj, dict):
            raise _broken(model.name, "returned a response body that is not a JSON object")
        if obj.get("error") is not None:
            raise _broken(model.name, f"reported an error: {_upstream_message(body)}")
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
