"""The simulator backend: deterministic text, OpenAI wire format, pacing, coalescing."""

from __future__ import annotations

import asyncio
import json
import random
import time
import tracemalloc
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import openai
import pytest
from aiohttp import web
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

from tests.pipeline import serve_app
from tidegate.apis import estimate_prompt_tokens
from tidegate.config import DEFAULT_MAX_OUTPUT_TOKENS, ModelConfig, SimulatorConfig
from tidegate.wire.protocol import Api, Request
from workers.backends import create_backend
from workers.backends.simulator import SimulatorBackend, SimulatorStream, TextPlan
from workers.backends.simulator import plan as sim_plan

CREATED_MS = 1_700_000_000_123
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me about tides."}]


def sim(ttft: float = 0.0, tps: float = 10_000.0, length: int = 16) -> SimulatorBackend:
    return SimulatorBackend(ModelConfig(
        name="sim", simulator=SimulatorConfig(ttft=ttft, tokens_per_second=tps, length=length)))


def make_request(api: Api = Api.CHAT, *, stream: bool = True, include_usage: bool = False,
                 rid: str = "r1", extra_body: dict[str, Any] | None = None,
                 **body: Any) -> Request:
    body.update(extra_body or {})
    if api == Api.CHAT:
        body.setdefault("messages", MESSAGES)
    else:
        body.setdefault("prompt", "Once upon a time")
    body.setdefault("model", "sim")
    return Request(id=rid, reply="_INBOX.x", model="sim", api=api, stream=stream, body=body,
                   created_ms=CREATED_MS, deadline_ms=CREATED_MS + 60_000,
                   window_bytes=1 << 16, window_msgs=128, include_usage=include_usage)


async def read_all(stream: SimulatorStream, max_bytes: int = 1 << 20) -> list[bytes]:
    chunks = []
    while chunk := await stream.read(max_bytes):
        chunks.append(chunk)
    assert await stream.read(max_bytes) == b""
    return chunks


def events(data: bytes) -> list[dict[str, Any]]:
    """Parse SSE bytes strictly: only complete ``data: {json}\\n\\n`` events."""
    assert data.endswith(b"\n\n")
    out = []
    for raw in data[:-2].split(b"\n\n"):
        assert raw.startswith(b"data: "), raw
        assert b"\n" not in raw
        assert raw != b"data: [DONE]"
        out.append(json.loads(raw[6:]))
    return out


async def run(request: Request, backend: SimulatorBackend | None = None,
              max_bytes: int = 1 << 20) -> tuple[list[dict[str, Any]], SimulatorStream]:
    stream = await (backend or sim()).open(request)
    data = b"".join(await read_all(stream, max_bytes))
    return (events(data) if request.stream else [json.loads(data)]), stream


def chat_text(evs: list[dict[str, Any]]) -> str:
    return "".join(e["choices"][0]["delta"].get("content", "") for e in evs if e["choices"])


async def test_create_backend_picks_simulator() -> None:
    from tidegate.config import WorkerConfig
    backend = create_backend(ModelConfig(name="sim"), WorkerConfig())
    assert isinstance(backend, SimulatorBackend)


async def test_chat_stream_shape() -> None:
    evs, stream = await run(make_request())
    assert len(evs) == 1 + 16 + 1
    for e in evs:
        assert e["id"] == "chatcmpl-r1"
        assert e["object"] == "chat.completion.chunk"
        assert e["created"] == CREATED_MS // 1000
        assert e["model"] == "sim"
        assert "usage" not in e
        ChatCompletionChunk.model_validate(e)
    assert evs[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}]
    for e in evs[1:-1]:
        assert e["choices"][0]["finish_reason"] is None
        assert set(e["choices"][0]["delta"]) == {"content"}
    assert evs[-1]["choices"] == [{"index": 0, "delta": {}, "logprobs": None,
                                   "finish_reason": "stop"}]
    text = chat_text(evs)
    assert len(text.split(" ")) == 16
    assert stream.usage.completion_tokens == 16
    assert stream.usage.finish_reason == "stop"
    assert stream.usage.prompt_tokens == estimate_prompt_tokens(Api.CHAT, {"messages": MESSAGES})


async def test_deterministic_per_prompt() -> None:
    a, _ = await run(make_request(rid="a"))
    b, _ = await run(make_request(rid="b"))
    other, _ = await run(make_request(messages=[{"role": "user", "content": "Something else"}]))
    seeded, _ = await run(make_request(seed=7))
    assert chat_text(a) == chat_text(b)
    assert chat_text(a) != chat_text(other)
    assert chat_text(a) != chat_text(seeded)
    # Same request, same bytes.
    s1 = await sim().open(make_request())
    s2 = await sim().open(make_request())
    assert b"".join(await read_all(s1)) == b"".join(await read_all(s2))


@pytest.mark.parametrize(("field", "value", "expected", "reason"), [
    ("max_tokens", 5, 5, "length"),
    ("max_completion_tokens", 3, 3, "length"),
    ("max_tokens", 40, 40, "length"),
    ("max_tokens", 0, 0, "length"),
])
async def test_max_tokens(field: str, value: int, expected: int, reason: str) -> None:
    evs, stream = await run(make_request(extra_body={field: value}))
    content = [e for e in evs[1:-1]]
    assert len(content) == expected
    assert evs[-1]["choices"][0]["finish_reason"] == reason
    assert stream.usage.completion_tokens == expected
    assert stream.usage.finish_reason == reason


async def test_both_limits_take_the_smaller() -> None:
    _, stream = await run(make_request(max_tokens=9, max_completion_tokens=4))
    assert stream.usage.completion_tokens == 4


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS, Api.RESPONSES])
async def test_a_huge_limit_is_cut_at_the_model_bound_without_memory(api: Api) -> None:
    """Issue 24: max_tokens 10^12 once made the simulator build a 10^12-token
    list (the worker grew to 23.8 GB). The plan is lazy and the model's
    max_output_tokens cuts it, whatever reached the worker."""
    backend = SimulatorBackend(ModelConfig(name="sim", max_output_tokens=50,
                                           simulator=SimulatorConfig(ttft=0.0,
                                                                     tokens_per_second=1e6)))
    field = "max_output_tokens" if api == Api.RESPONSES else "max_tokens"
    body: dict[str, Any] = {field: 10**12, "stop": "zzz-not-there"}
    if api == Api.RESPONSES:
        body["input"] = "hi"
    tracemalloc.start()
    try:
        stream = await backend.open(make_request(api, extra_body=body))
        opened, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert opened < 64 << 10
    assert len(b"".join(await read_all(stream))) > 0
    assert stream.usage.completion_tokens == 50
    assert stream.usage.finish_reason in ("length", "incomplete")
    plan = sim_plan(Api.CHAT, {"max_tokens": 10**12}, SimulatorConfig(), 10**12)
    assert len(plan) == 10**12
    assert plan[1].startswith(" ")


async def test_stop_strings() -> None:
    full = chat_text((await run(make_request(max_tokens=30)))[0])
    words = full.split(" ")
    # A stop string inside one token, one spanning two tokens, and a list.
    cases: list[str | list[str]] = [
        " " + words[5],
        words[3][-1] + " " + words[4][:2],
        ["zzz-not-there", " " + words[7], " " + words[2]],
    ]
    for stop in cases:
        stops = [stop] if isinstance(stop, str) else stop
        cut = min(i for i in (full.find(s) for s in stops) if i >= 0)
        evs, stream = await run(make_request(max_tokens=30, stop=stop))
        assert chat_text(evs) == full[:cut], stop
        assert evs[-1]["choices"][0]["finish_reason"] == "stop"
        assert stream.usage.finish_reason == "stop"
        assert stream.usage.completion_tokens == len(evs) - 2
    evs, stream = await run(make_request(max_tokens=30, stop="zzz-not-there"))
    assert chat_text(evs) == full
    assert stream.usage.finish_reason == "length"


def test_stop_cut_is_the_earliest_occurrence_in_the_text() -> None:
    """The block-wise search (workers.backends.simulator._find_cut) against
    a plain search of the whole text: stops inside a piece, across pieces and
    blocks, absent, longer than a block; at one start the shorter stop wins."""
    rng = random.Random(44)
    for _ in range(400):
        seed, count = rng.randrange(1 << 64), rng.choice([1, 2, 7, 300, 5000, 9000])
        text = "".join(TextPlan(seed, count, "length", []))
        stops = [text[a:a + rng.randint(1, 40)] if rng.random() < 0.7
                 else rng.choice(["zz", " tide gate", "x" * 50, "e", " ", "the" * 3000])
                 for a in (rng.randrange(len(text)) for _ in range(rng.randint(1, 4)))]
        planned = TextPlan(seed, count, "length", stops)
        hits = [(at, len(stop), stop) for stop in stops if (at := text.find(stop)) >= 0]
        if not hits:
            assert (len(planned), planned.finish, planned.stopped_by) == (count, "length", "")
            continue
        cut, _, stop = min(hits)
        assert "".join(planned) == text[:cut], (seed, count, stops)
        assert (planned.finish, planned.stopped_by) == ("stop", stop)


def test_stop_strings_the_edge_does_not_check_cost_the_worker_nothing() -> None:
    """A Responses body's ``stop`` is a vendor field the edge passes on
    unchecked: the simulator ignores it (OpenAI's Responses API has none). A
    list longer than any dialect admits is read up to 16 (Messages' bound)."""
    sim = SimulatorConfig()
    text = "".join(sim_plan(Api.CHAT, {"max_tokens": 50}, sim, 50))
    assert sim_plan(Api.CHAT, {"max_tokens": 50, "stop": text[10:20]}, sim, 50).finish == "stop"
    planned = sim_plan(Api.RESPONSES, {"max_output_tokens": 50, "input": "hi",
                                       "stop": ["the", " ", "e"]}, sim, 50)
    assert (len(planned), planned.finish) == (50, "length")
    many = ["zz"] * 16 + [text[10:20]]
    planned = sim_plan(Api.CHAT, {"max_tokens": 50, "stop": many}, sim, 50)
    assert (len(planned), planned.finish) == (50, "length")


async def loop_lag(work: Awaitable[Any]) -> tuple[float, float]:
    """The worst event loop lag (a 5 ms sleep's overshoot) while ``work``
    runs, and over as long a time with the loop idle before it: the box's own
    noise, so a bound can be its sum with what the work may add."""
    async def worst(until: asyncio.Future[Any] | float) -> float:
        lag = 0.0
        while (not until.done() if isinstance(until, asyncio.Future)
               else time.monotonic() < until):
            t = time.monotonic()
            await asyncio.sleep(0.005)
            lag = max(lag, time.monotonic() - t - 0.005)
        return lag

    baseline = await worst(time.monotonic() + 0.3)
    task = asyncio.ensure_future(work)
    busy = await worst(task)
    await task
    return busy, baseline


async def test_stop_strings_never_hold_the_loop() -> None:
    """Issue 44 row 2: four 120,000-character stop strings and max_tokens
    262144 froze the worker's loop ~100 s; at the edge's bound (4 x 1,000
    characters) it still froze ~1 s. Finding the cut is linear and off the loop."""
    backend = SimulatorBackend(ModelConfig(name="sim", simulator=SimulatorConfig(
        ttft=0.0, tokens_per_second=1e6)))
    for stop in (["x" * 1000] * 4, ["x" * 120_000] * 4):
        request = make_request(max_tokens=DEFAULT_MAX_OUTPUT_TOKENS, stop=stop)
        busy, baseline = await loop_lag(backend.open(request))
        assert busy < 0.05 + baseline, (len(stop[0]), busy, baseline)


@pytest.mark.parametrize("stream", [True, False])
async def test_the_whole_text_is_joined_off_the_loop(stream: bool) -> None:
    """A Responses stream joined its whole text for each of its first four
    events (136-173 ms on the loop at 262,144 tokens); a non-streaming body
    (52 ms) and the closing events join it once, in a thread."""
    backend = SimulatorBackend(ModelConfig(name="sim", simulator=SimulatorConfig(
        ttft=0.0, tokens_per_second=1e7)))
    opened = await backend.open(make_request(
        Api.RESPONSES, stream=stream, input="hi",
        extra_body={"max_output_tokens": DEFAULT_MAX_OUTPUT_TOKENS}))
    busy, baseline = await loop_lag(opened.read(1 << 16))
    assert busy < 0.05 + baseline, (busy, baseline)


async def test_completions_stream_shape() -> None:
    req = make_request(Api.COMPLETIONS, max_tokens=6)
    evs, stream = await run(req)
    assert len(evs) == 7
    for e in evs:
        assert e["id"] == "cmpl-r1"
        assert e["object"] == "text_completion"
        assert e["created"] == CREATED_MS // 1000
    # The SDK's Completion type only admits a finish_reason on the final chunk
    # (the SDK does not validate streamed chunks; OpenAI sends null there too).
    Completion.model_validate(evs[-1])
    assert all(e["choices"][0]["finish_reason"] is None for e in evs[:-1])
    assert evs[-1]["choices"] == [{"text": "", "index": 0, "logprobs": None,
                                   "finish_reason": "length"}]
    text = "".join(e["choices"][0]["text"] for e in evs)
    assert len(text.split(" ")) == 6
    assert stream.usage.prompt_tokens == estimate_prompt_tokens(Api.COMPLETIONS, req.body)
    assert stream.usage.prompt_tokens > 0


@pytest.mark.parametrize("api", [Api.CHAT, Api.COMPLETIONS])
async def test_include_usage(api: Api) -> None:
    evs, stream = await run(make_request(api, include_usage=True, max_tokens=5))
    *body, last = evs
    for e in body:
        assert "usage" in e
        assert e["usage"] is None
        assert len(e["choices"]) == 1
    assert last["choices"] == []
    prompt = stream.usage.prompt_tokens
    assert prompt > 0
    assert last["usage"] == {"prompt_tokens": prompt, "completion_tokens": 5,
                             "total_tokens": prompt + 5}
    if api == Api.CHAT:
        ChatCompletionChunk.model_validate(last)


async def test_non_stream_chat_body_in_slices() -> None:
    stream = await sim().open(make_request(stream=False, max_tokens=7))
    chunks = await read_all(stream, max_bytes=50)
    assert len(chunks) > 3
    assert all(len(c) <= 50 for c in chunks)
    body = json.loads(b"".join(chunks))
    parsed = ChatCompletion.model_validate(body)
    assert body["object"] == "chat.completion"
    assert body["id"] == "chatcmpl-r1"
    assert parsed.choices[0].message.role == "assistant"
    assert len((parsed.choices[0].message.content or "").split(" ")) == 7
    assert parsed.choices[0].finish_reason == "length"
    assert body["usage"]["completion_tokens"] == 7
    assert stream.usage.completion_tokens == 7
    assert stream.usage.finish_reason == "length"
    # Same text as the streaming answer to the same request.
    evs, _ = await run(make_request(max_tokens=7))
    assert parsed.choices[0].message.content == chat_text(evs)


async def test_non_stream_completions_body() -> None:
    (body,), stream = await run(make_request(Api.COMPLETIONS, stream=False, stop=" the"))
    parsed = Completion.model_validate(body)
    assert body["object"] == "text_completion"
    assert body["id"] == "cmpl-r1"
    assert parsed.choices[0].finish_reason == "stop"
    assert parsed.usage is not None
    assert parsed.usage.completion_tokens == stream.usage.completion_tokens
    assert " the" not in parsed.choices[0].text


async def test_paced_by_ttft_and_rate() -> None:
    backend = sim(ttft=0.1, tps=50, length=10)
    start = time.monotonic()
    stream = await backend.open(make_request())
    first = await stream.read(1 << 20)
    ttft = time.monotonic() - start
    rest = await read_all(stream)
    total = time.monotonic() - start
    assert 0.095 <= ttft < 1.0  # paced (lower bound); the upper one only catches a hang
    # Role chunk and first token come together at TTFT.
    assert len(events(first)) == 2
    # Then one token every 20 ms: paced reads (a loaded machine may coalesce a few).
    assert sum(len(events(c)) for c in rest) == 9 + 1
    assert len(rest) >= 5
    assert 0.1 + 9 * 0.02 - 0.005 <= total < 2.0


async def test_non_stream_waits_for_the_whole_generation() -> None:
    backend = sim(ttft=0.05, tps=100, length=10)
    start = time.monotonic()
    stream = await backend.open(make_request(stream=False))
    await stream.read(1 << 20)
    assert time.monotonic() - start >= 0.05 + 9 * 0.01 - 0.005


async def test_late_reader_gets_due_tokens_coalesced() -> None:
    backend = sim(ttft=0.0, tps=200, length=40)
    stream = await backend.open(make_request(include_usage=True))
    await asyncio.sleep(0.1)  # ~20 tokens are due by now
    chunk = await stream.read(1 << 20)
    evs = events(chunk)
    assert 15 <= len(evs) <= 42
    assert stream.usage.completion_tokens == len(evs) - 1
    # max_bytes bounds a coalesced read, but never splits an event.
    await asyncio.sleep(0.1)
    small = await stream.read(600)
    assert len(small) <= 600
    assert len(events(small)) >= 2
    tiny = await stream.read(1)
    assert len(events(tiny)) == 1  # one whole event even when larger than max_bytes
    rest = b"".join(await read_all(stream))
    all_events = evs + events(small) + events(tiny) + events(rest)
    assert len(all_events) == 1 + 40 + 1 + 1
    assert all_events[-1]["usage"]["completion_tokens"] == 40


async def test_close_early_counts_generated_tokens() -> None:
    stream = await sim(ttft=0.0, tps=100, length=2000).open(make_request())
    await stream.read(1 << 20)
    await asyncio.sleep(0.105)
    await stream.aclose()
    await stream.aclose()  # idempotent
    # Tokens due by now (~11, more on a loaded machine), not only the one
    # read; never the full 2000 (20 s of generation).
    assert 8 <= stream.usage.completion_tokens < 2000
    assert stream.usage.finish_reason == ""
    assert await stream.read(1 << 20) == b""


# --- the official SDK reads the simulator's bytes over real HTTP ---------------------------


@pytest.fixture
async def sdk_server() -> AsyncIterator[str]:
    """A minimal HTTP front for the simulator, writing its bytes as the edge does."""
    backend = sim(ttft=0.0, tps=2000, length=12)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        api = Api.CHAT if request.path.endswith("/chat/completions") else Api.COMPLETIONS
        options = body.get("stream_options") or {}
        req = Request(id="sdk", reply="_INBOX.x", model=body["model"], api=api,
                      stream=bool(body.get("stream")), body=body, created_ms=CREATED_MS,
                      deadline_ms=CREATED_MS + 60_000, window_bytes=1 << 16, window_msgs=128,
                      include_usage=bool(options.get("include_usage")))
        stream = await backend.open(req)
        if not req.stream:
            return web.Response(body=b"".join(await read_all(stream)),
                                content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        while chunk := await stream.read(1 << 16):
            await resp.write(chunk)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_post("/v1/completions", handle)
    async with serve_app(app) as base_url:
        yield f"{base_url}/v1"


SDK_MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Tell me about tides."},
]


async def test_openai_sdk_parses_simulator_output(sdk_server: str) -> None:
    client = openai.AsyncOpenAI(base_url=sdk_server, api_key="unused", max_retries=0)
    async with client:
        chunks = [c async for c in await client.chat.completions.create(
            model="sim", messages=SDK_MESSAGES, stream=True,
            stream_options={"include_usage": True})]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-2].choices[0].finish_reason == "stop"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 12
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        whole = await client.chat.completions.create(model="sim", messages=SDK_MESSAGES)
        assert whole.choices[0].message.content == streamed
        assert whole.usage is not None
        assert whole.usage.completion_tokens == 12

        comp = [c async for c in await client.completions.create(
            model="sim", prompt="hi", max_tokens=4, stream=True)]
        assert "".join(c.choices[0].text for c in comp).count(" ") == 3
        assert comp[-1].choices[0].finish_reason == "length"


async def test_prefix_cache_model_shortens_a_repeated_prefix() -> None:
    """simulator.prefill_per_char: the first token waits for the prompt the
    worker's cache did not hold, so a chat's next turn starts sooner."""
    backend = SimulatorBackend(ModelConfig(name="sim", simulator=SimulatorConfig(
        ttft=0.0, tokens_per_second=10_000.0, length=2, prefill_per_char=0.0004)))
    system = {"role": "system", "content": "Be brief. " * 60}  # 600 chars: 2 blocks

    async def first_token(messages: list[dict[str, str]]) -> float:
        stream = await backend.open(make_request(messages=messages))
        started = time.monotonic()
        await stream.read(1 << 16)
        took = time.monotonic() - started
        await stream.aclose()
        return took

    cold = await first_token([system, {"role": "user", "content": "one"}])
    warm = await first_token([system, {"role": "user", "content": "one"},
                              {"role": "assistant", "content": "ok"},
                              {"role": "user", "content": "two"}])
    other = await first_token([{"role": "system", "content": "Be long. " * 70},
                               {"role": "user", "content": "one"}])
    assert cold > 0.2  # about 620 uncached chars x 0.4 ms
    assert warm < cold / 2  # the two 256-char blocks came from the cache
    assert other > 0.2  # another conversation's prefix is not cached
