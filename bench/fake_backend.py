"""A fake OpenAI-compatible model server, for tests and the benchmark suite.

It serves ``/v1/models``, chat and completions, streaming and not
(``bench.fake_responses`` adds Responses and embeddings, ``bench.fake_messages``
Messages and tool calls), paces tokens like a model and records every request,
so a test can assert the gateway closed the connection (:attr:`FakeRecord.closed_at`).

Faults, per request, by header or the same-named body field (a header wins):
``x-fake-status``, ``x-fake-message``, ``x-fake-fail-after`` (N events, then a
drop), ``x-fake-ttft`` / ``x-fake-itl``, ``x-fake-header-delay``,
``x-fake-cached-tokens``. Per fake: ``fail_after`` / ``fail_with`` (a failing
replica) and ``saturate_at = K`` (past K streams every step is scaled by N / K).

    python -m bench.fake_backend --port 8001 --ttft 0.05 --itl 0.01 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import itertools
import json
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from bench import fake_messages, fake_responses
from bench.fake_records import FakeConfig, FakeRecord, _Faults
from workers.backends.greedy import base_and_prefix, greedy_plan, seed_of
from workers.backends.prefix_cache import PrefixCache, prompt_text

__all__ = ["FakeBackend", "FakeConfig", "FakeRecord", "main"]

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_DONE = b"data: [DONE]\n\n"
# What vLLM streams when the engine fails after the response began (its 5xx).
_MIDSTREAM_ERROR = (b'data: {"error":{"object":"error","message":"fake backend: injected '
                    b'failure mid-stream","type":"InternalServerError","param":null,'
                    b'"code":500}}\n\n')
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}


class _ClientGone(Exception):
    """A write failed because the client closed the connection."""


def _error_body(status: int, message: str) -> bytes:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}).encode()


def _prompt_tokens(body: Mapping[str, Any]) -> int:
    chars = 0
    for message in body.get("messages") or ():
        if isinstance(message, Mapping) and isinstance(message.get("content"), str):
            chars += len(message["content"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        chars += sum(len(p) for p in prompt if isinstance(p, str))
    return (chars + 3) // 4


class FakeBackend:
    """The fake server. ``start`` binds it, ``stop`` shuts it down.

    ``records`` grows by one per generation request, in arrival order.
    """

    def __init__(self, config: FakeConfig | None = None, *, ttft: float | None = None,
                 itl: float | None = None, tokens: int | None = None,
                 token_size: int | None = None, models: Sequence[str] | None = None,
                 keep_output: bool | None = None, saturate_at: int | None = None) -> None:
        """``FakeBackend(FakeConfig(...))`` or ``FakeBackend(ttft=..., models=[...])``;
        keyword arguments override the config's fields."""
        overrides: dict[str, Any] = {
            k: v for k, v in (("ttft", ttft), ("itl", itl), ("tokens", tokens),
                              ("token_size", token_size), ("keep_output", keep_output),
                              ("saturate_at", saturate_at))
            if v is not None}
        if models is not None:
            overrides["models"] = tuple(models)
        self.config = dataclasses.replace(config or FakeConfig(), **overrides)
        self.records: list[FakeRecord] = []
        self.active = 0  # generations in progress (what saturate_at compares)
        self.peak_active = 0
        self.base_url = ""
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        size = max(1, self.config.token_size)
        self._texts = [" " + c * (size - 1) if size > 1 else c for c in _LETTERS]
        self._pieces = [json.dumps(t).encode() for t in self._texts]
        self.prefix_cache = PrefixCache(capacity_blocks=self.config.cache_blocks)
        self.kv_usage = 0.0  # what /metrics reports (report_load)
        # report_load: per chat (the request's `user`), the message count of
        # each of its turns served here (GET /fake/turns; the affinity bench).
        self.turns: dict[str, list[int]] = {}
        self.waiting = 0
        # ... and these totals (hits: requests that found any of their prompt cached)
        self._served = self._prompt_chars = self._cached_chars = self._hits = 0

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind and serve; returns the base URL, ending in ``/v1``."""
        app = web.Application(client_max_size=64 << 20)  # vision bodies: tens of MiB
        app.router.add_get("/v1/models", self._models)
        if self.config.report_load:
            app.router.add_get("/metrics", self._metrics)
            app.router.add_get("/fake/turns", self._turns_served)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_post("/v1/completions", self._generate)
        if self.config.responses:
            app.router.add_post("/v1/responses", self._generate)
        if self.config.embeddings:
            app.router.add_post("/v1/embeddings", self._generate)
        if self.config.messages:
            app.router.add_post("/v1/messages", self._generate)
        # handler_cancellation: a client that disconnects cancels its handler at
        # once, so closed_at is exact even while the fake is "thinking" (TTFT).
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                               shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        bound_host, bound_port = runner.addresses[0][:2]
        self.base_url = f"http://{bound_host}:{bound_port}/v1"
        return self.base_url

    def load(self) -> float:
        """The slow-down factor now: ``max(1, active / saturate_at``), 1 when off."""
        k = self.config.saturate_at
        return self.active / k if k and self.active > k else 1.0

    async def stop(self) -> None:
        """Stop serving; open streams are cut after a one second grace period."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def __aenter__(self) -> FakeBackend:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _metrics(self, request: web.Request) -> web.Response:
        """vLLM's load gauges, from :attr:`kv_usage` and :attr:`waiting` (set
        by a test) and the requests open now."""
        running = sum(1 for r in self.records[-1000:] if r.finished_at is None)
        return web.Response(text=(
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="fake"}} {self.kv_usage}\n'
            f'vllm:num_requests_waiting{{model_name="fake"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="fake"}} {running}\n'
            f"fake_requests_total {self._served}\n"
            f"fake_prompt_chars_total {self._prompt_chars}\n"
            f"fake_cached_chars_total {self._cached_chars}\n"
            f"fake_cache_hits_total {self._hits}\n"))

    async def _turns_served(self, request: web.Request) -> web.Response:
        return web.json_response(self.turns)

    async def _models(self, request: web.Request) -> web.Response:
        names = self.config.models or ("fake-model",)
        return web.json_response({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "tidegate-fake"}
            for n in names]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        record = FakeRecord(id=next(self._ids), path=request.path,
                            started_at=time.monotonic(), headers=dict(request.headers),
                            peer=f"{peer[0]}:{peer[1]}" if peer else "")
        self.records.append(record)
        if len(self.records) > self.config.max_records:
            del self.records[: len(self.records) - self.config.max_records]
        self.active += 1
        self.peak_active = max(self.peak_active, self.active)
        try:
            return await self._answer(request, record)
        except asyncio.CancelledError:
            # handler_cancellation: the client closed the connection.
            if not (record.completed or record.dropped) and record.closed_at is None:
                record.closed_at = time.monotonic()
            raise
        except _ClientGone:
            record.closed_at = time.monotonic()
            return web.Response(status=499)
        finally:
            self.active -= 1
            record.finished_at = time.monotonic()

    async def _answer(self, request: web.Request, record: FakeRecord) -> web.StreamResponse:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body is not a JSON object")
        except ValueError as exc:
            return self._error(record, 400, f"invalid JSON body: {exc}")
        record.body = body
        try:
            faults = _Faults.parse(request.headers, body)
        except (TypeError, ValueError) as exc:
            return self._error(record, 400, f"bad x-fake injection: {exc}")
        if faults.header_delay > 0:
            await asyncio.sleep(faults.header_delay)
        status = faults.status or self.config.status
        if status:
            return self._error(record, status,
                               faults.message or f"fake backend: injected HTTP {status}")
        chat = request.path.endswith("/chat/completions")
        model = body.get("model")
        if not isinstance(model, str) or (self.config.models and model not in self.config.models):
            return self._error(record, 404, f"The model `{model}` does not exist.")
        if request.path.endswith("/responses"):
            return await fake_responses.answer_responses(self, request, record, body, faults)
        if request.path.endswith("/embeddings"):
            return await fake_responses.answer_embeddings(self, request, record, body, faults)
        if request.path.endswith("/messages"):
            return await fake_messages.answer_messages(self, request, record, body, faults)
        if chat and fake_messages.wants_tool_call(self, body):
            return await fake_messages.answer_tool_call(self, request, record, body, faults)
        if chat and not isinstance(body.get("messages"), list):
            return self._error(record, 400, "messages: field required")
        if self.config.report_load and chat and isinstance(body.get("user"), str):
            self.turns.setdefault(body["user"], []).append(len(body["messages"]))
        if not chat and body.get("prompt") is None:
            return self._error(record, 400, "prompt: field required")
        limit = body.get("max_completion_tokens") if chat else None
        if limit is None:
            limit = body.get("max_tokens")
        n = self.config.tokens if limit is None else max(0, min(int(limit), self.config.tokens))
        finish = "length" if limit is not None and int(limit) <= self.config.tokens else "stop"
        texts, pieces = self._texts, self._pieces
        created, ident = int(time.time()), f"{'chatcmpl' if chat else 'cmpl'}-fake{record.id}"
        if self.config.deterministic:
            plan = greedy_plan(chat, body, None if limit is None else int(limit),
                               self.config.tokens)
            n, finish, texts = len(plan), plan.finish, list(plan)
            pieces = [json.dumps(t).encode() for t in texts]
            seed = seed_of(base_and_prefix(chat, body)[0])
            created, ident = 1_700_000_000, f"{'chatcmpl' if chat else 'cmpl'}-det{seed:016x}"
        ttft = self.config.ttft if faults.ttft is None else faults.ttft
        if self.config.prefill_per_char > 0:
            record.cached_chars, record.prompt_chars = self.prefix_cache.lookup(
                prompt_text(body, chat))
            ttft += self.config.prefill_per_char * (record.prompt_chars - record.cached_chars)
            self._prompt_chars += record.prompt_chars
            self._cached_chars += record.cached_chars
            self._hits += record.cached_chars > 0
        self._served += 1
        itl = self.config.itl if faults.itl is None else faults.itl
        head = (b'{"id":' + json.dumps(ident).encode() + b',"object":"'
                + (b"chat.completion" if chat else b"text_completion")
                + (b".chunk" if chat and body.get("stream") else b"")
                + b'","created":%d,"model":' % created
                + json.dumps(model).encode() + b',"choices":[')
        usage = (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d'
                 % (p := _prompt_tokens(body), n, p + n)
                 + (b',"prompt_tokens_details":{"cached_tokens":%d}' % faults.cached_tokens
                    if faults.cached_tokens else b"") + b"}")
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, Mapping) and bool(options.get("include_usage"))
            return await self._stream(request, record, faults, chat, head, usage, n, finish,
                                      ttft, itl, include_usage, pieces)
        await asyncio.sleep((ttft + itl * max(n - 1, 0)) * self.load())
        text = json.dumps("".join(texts[i % len(texts)] for i in range(n))).encode()
        if chat:
            choice = b'{"index":0,"message":{"role":"assistant","content":' + text + b"}"
        else:
            choice = b'{"index":0,"text":' + text
        data = (head + choice + b',"logprobs":null,"finish_reason":"%s"}],"usage":'
                % finish.encode() + usage + b"}")
        record.bytes_written = len(data)
        if self.config.keep_output:
            record.output += data
        record.completed = True
        return web.Response(body=data, content_type="application/json")

    def _error(self, record: FakeRecord, status: int, message: str) -> web.Response:
        record.status = status
        record.completed = True
        return web.Response(status=status, body=_error_body(status, message),
                            content_type="application/json")

    async def _stream(self, request: web.Request, record: FakeRecord, faults: _Faults,
                      chat: bool, head: bytes, usage: bytes, n: int, finish: str,
                      ttft: float, itl: float, include_usage: bool,
                      pieces: Sequence[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        tail = b',"usage":null}\n\n' if include_usage else b"}\n\n"
        if chat:
            tok_prefix = b"data: " + head + b'{"index":0,"delta":{"content":'
            tok_suffix = b'},"logprobs":null,"finish_reason":null}]' + tail
            last = b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"%s"}]'
        else:
            tok_prefix = b"data: " + head + b'{"index":0,"text":'
            tok_suffix = b',"logprobs":null,"finish_reason":null}]' + tail
            last = b'{"index":0,"text":"","logprobs":null,"finish_reason":"%s"}]'
        events: list[bytes] = []
        if chat:
            events.append(b"data: " + head + b'{"index":0,"delta":{"role":"assistant",'
                          b'"content":""},"logprobs":null,"finish_reason":null}]' + tail)
        fail_after, fail_with = faults.fail_after, "drop"
        if fail_after < 0:
            fail_after, fail_with = self.config.fail_after, self.config.fail_with
        record.slowdown = self.load()
        due = time.monotonic() + ttft * record.slowdown
        for i in range(n + 1):
            if i < n:
                events.append(tok_prefix + pieces[i % len(pieces)] + tok_suffix)
            else:
                events.append(b"data: " + head + last % finish.encode() + tail)
                if include_usage:
                    events.append(b"data: " + head + b'],"usage":' + usage + b"}\n\n")
                events.append(_DONE)
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for event in events:
                if record.events_written == fail_after:
                    record.dropped = True
                    if fail_with == "error":  # the end of the body stays clean
                        await self._write(resp, record, _MIDSTREAM_ERROR)
                        await self._write(resp, record, _DONE)
                        with contextlib.suppress(ConnectionError):
                            await resp.write_eof()
                        return resp
                    # Abrupt drop: no terminating chunk, so the client sees a
                    # truncated body, as when a backend process dies.
                    if request.transport is not None:
                        request.transport.close()
                    return resp
                await self._write(resp, record, event)
            if record.first_byte_at is None:
                record.first_byte_at = time.monotonic()
            events.clear()
            due += itl * self.load()
        record.completed = True
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    async def _write(self, resp: web.StreamResponse, record: FakeRecord, data: bytes) -> None:
        try:
            await resp.write(data)
        except ConnectionError as exc:  # aiohttp's ClientConnectionResetError is one
            raise _ClientGone from exc
        record.bytes_written += len(data)
        record.events_written += 1
        if self.config.keep_output:
            record.output += data


async def _serve(config: FakeConfig, host: str, port: int) -> None:
    fake = FakeBackend(config)
    url = await fake.start(host, port)
    print(f"fake backend serving at {url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):  # Windows
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main(argv: list[str] | None = None) -> None:
    """Command line entry point: serve until SIGINT/SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m bench.fake_backend",
                                     description="Fake OpenAI-compatible model server.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--ttft", type=float, default=0.05, help="seconds to first token")
    parser.add_argument("--itl", type=float, default=0.01, help="seconds between tokens")
    parser.add_argument("--tokens", type=int, default=64, help="tokens without max_tokens")
    parser.add_argument("--token-size", type=int, default=4, help="bytes of text per token")
    parser.add_argument("--model", action="append", default=[],
                        help="model name to serve (repeatable; default: any)")
    parser.add_argument("--prefill-per-char", type=float, default=0.0,
                        help="prefix-cache model: seconds of TTFT per uncached prompt char")
    parser.add_argument("--cache-blocks", type=int, default=4096,
                        help="prefix-cache model: 256-char blocks kept (LRU)")
    parser.add_argument("--report-load", action="store_true",
                        help="serve vLLM-style /metrics (and request/prompt/cache totals)")
    parser.add_argument("--deterministic", action="store_true",
                        help="greedy-model text: token i = f(prompt, i), assistant prefixes "
                             "continued")
    parser.add_argument("--fail-after", type=int, default=-1,
                        help="fail every chat/completions stream after N events (-1: never)")
    parser.add_argument("--fail-with", choices=("drop", "error"), default="drop",
                        help="with --fail-after: drop the connection, or an error event")
    parser.add_argument("--saturate-at", type=int, default=0,
                        help="past this many concurrent streams, slow down like a GPU batch")
    args = parser.parse_args(argv)
    config = FakeConfig(ttft=args.ttft, itl=args.itl, tokens=args.tokens,
                        token_size=args.token_size, models=tuple(args.model),
                        prefill_per_char=args.prefill_per_char, cache_blocks=args.cache_blocks,
                        saturate_at=args.saturate_at, report_load=args.report_load,
                        deterministic=args.deterministic, fail_after=args.fail_after,
                        fail_with=args.fail_with)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(config, args.host, args.port))


if __name__ == "__main__":
    main()
