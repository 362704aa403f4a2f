"""The built-in model: deterministic text at a configured pace, in OpenAI's wire format.

Runs and benchmarks the whole pipeline without a GPU; the ``openai`` SDK parses it.

Invariants: the text depends only on the prompt (and ``seed``); token ``i`` is due
``ttft + i / tokens_per_second`` after :meth:`SimulatorBackend.open`, whether or
not anyone reads (a reader behind gets every due token at once, up to
``max_bytes``); without a token limit it writes ``simulator.length`` tokens and
``"stop"``, with one exactly that many and ``"length"`` (cut at the model's
``max_output_tokens``); a ``stop`` string ends the text before it, found in a
thread (:func:`plan_off_loop`) in linear time; per token only the token text is
encoded. One choice only (``n`` is ignored). Docs: docs/backends.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from math import floor
from typing import Any, overload

from tidegate import apis
from tidegate.apis import estimate_prompt_tokens
from tidegate.config import (
    DEFAULT_MAX_OUTPUT_TOKENS,
    ModelConfig,
    SimulatorConfig,
    WorkerConfig,
)
from tidegate.control.prices import PRICE_EXTRA, cost_member
from tidegate.validation.messages import MAX_STOP_SEQUENCES
from tidegate.wire.protocol import Api, Request
from workers.backends.base import BackendStream, Usage
from workers.backends.greedy import GreedyPlan, greedy_plan
from workers.backends.paced import PacedStream
from workers.backends.prefix_cache import PrefixCache, prompt_text
from workers.backends.simulator_responses import SimulatorEmbeddings, SimulatorResponsesStream
from workers.backends.simulator_tools import (
    SimulatorResponsesToolCall,
    SimulatorToolCall,
    wants_tool_call,
)

__all__ = ["SimulatorBackend", "SimulatorStream", "TextPlan", "plan", "plan_text"]

_WORDS = (
    "the", "of", "and", "to", "in", "is", "that", "it", "for", "on", "with", "as", "was", "at",
    "by", "an", "be", "this", "from", "or", "are", "tide", "gate", "river", "harbor",
    "current", "vessel", "anchor", "signal", "stream", "window", "credit", "ack", "broker",
    "worker", "model", "token", "quiet", "steady", "bright", "amber", "silver", "ocean",
    "northern", "moves", "carries", "holds", "waits", "returns", "opens", "closes", "drifts",
    "rises", "falls", "turns", "slowly", "gently", "always", "never", "again", "before",
    "after", "under", "over", "through", "across",
)

# JSON string literal of every piece a stream can emit untruncated: the word
# alone (first token) or with its leading space. A stop string can truncate a
# piece; only that one is encoded on the fly.
_PIECE_JSON: dict[str, bytes] = {}
for _w in _WORDS:
    for _p in (_w, " " + _w):
        _PIECE_JSON[_p] = json.dumps(_p).encode()


def _stops(api: Api, body: Mapping[str, Any]) -> list[str]:
    """The stop strings the simulator honours. The Responses API has none (a
    ``stop`` there is a vendor field the edge does not check), and of a list
    longer than any dialect admits (a body that reached the worker some other
    way) only the first ones count: finding them costs a pass per string."""
    field = apis.of(api).stop_field
    stop = body.get(field) if field else None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop[:MAX_STOP_SEQUENCES] if isinstance(s, str) and s]


def _seed(api: Api, body: Mapping[str, Any]) -> int:
    dialect = apis.of(api)
    material = {
        "prompt": body.get("messages") if dialect.openai_chat else body.get("prompt"),
        "seed": body.get("seed"),
    }
    if dialect.background:  # Responses: its instructions and input
        material = {"prompt": body.get("input"), "instructions": body.get("instructions")}
    raw = json.dumps(material, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


# Every piece a stream emits untruncated is one of these shared strings, so a
# plan holds no per-token string of its own.
_SPACED = tuple(" " + w for w in _WORDS)
_NWORDS = float(len(_WORDS))


class TextPlan(Sequence[str]):
    """The pieces (one per emitted token) of one simulated answer, generated
    lazily: the plan holds a seed, a count and at most one cached piece, never
    a list as long as the answer, so memory does not grow with ``max_tokens``.

    Piece ``i`` is ``_WORDS[floor(random() * len)]`` of the ``i``-th draw of a
    generator seeded from the request, the same sequence ``rng.choices(_WORDS,
    k=count)`` gives (``random.Random.choices`` draws exactly so). Indexing is
    for the streams' in-order reads: the next index is drawn, the last one
    repeats from a one-piece cache, anything else replays from the seed.
    A stop string cuts the plan at its earliest start (``len`` and the last
    piece say so); finding that start reads the text once, a block at a time
    (:func:`_find_cut`), so it too needs no memory per token.
    """

    __slots__ = ("_count", "_cut", "_last", "_last_index", "_rng", "_seed", "finish",
                 "stopped_by")

    def __init__(self, seed: int, count: int, finish: str, stops: list[str]) -> None:
        self._seed = seed
        self._count = count
        self.finish = finish
        # (tokens kept, length of the last kept piece or -1 = whole)
        self.stopped_by = ""  # the stop string that cut the text, as vLLM reports it
        found = _find_cut(seed, count, stops) if stops else None
        self._cut: tuple[int, int] | None = found[:2] if found is not None else None
        if found is not None:
            self._count = found[0]
            self.finish = "stop"
            self.stopped_by = found[2]
        self._rng = random.Random(seed)
        self._last_index = -1
        self._last = ""

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[str]: ...
    def __getitem__(self, index: int | slice) -> str | Sequence[str]:
        if isinstance(index, slice):
            return list(self)[index]
        if index < 0:
            index += self._count
        if not 0 <= index < self._count:
            raise IndexError(index)
        if index != self._last_index:
            if index < self._last_index:
                self._rng = random.Random(self._seed)
                self._last_index = -1
            while self._last_index < index:
                self._last_index += 1
                self._last = self._draw(self._rng, self._last_index)
        return self._last

    def __iter__(self) -> Iterator[str]:
        rng = random.Random(self._seed)
        for i in range(self._count):
            yield self._draw(rng, i)

    def _draw(self, rng: random.Random, i: int) -> str:
        k = floor(rng.random() * _NWORDS)
        piece = _WORDS[k] if i == 0 else _SPACED[k]
        if self._cut is not None and i == self._count - 1 and self._cut[1] >= 0:
            piece = piece[: self._cut[1]]
        return piece


# Pieces drawn, joined and searched at a time when looking for stop strings:
# large enough that the C-level search, not the Python loop, does the work.
_CUT_BLOCK = 4096


def _blocks(seed: int, count: int, size: int) -> Iterator[list[str]]:
    """The plan's pieces ``size`` at a time: ``random.Random.choices`` draws
    ``floor(random() * n)`` per piece, the same indices :meth:`TextPlan._draw` reads."""
    rng = random.Random(seed)
    for drawn in range(0, count, size):
        pieces = rng.choices(_SPACED, k=min(size, count - drawn))
        if drawn == 0:
            pieces[0] = pieces[0][1:]  # the first piece has no leading space
        yield pieces


def _find_cut(seed: int, count: int, stops: list[str]) -> tuple[int, int, str] | None:
    """Where the earliest occurrence of any stop string starts in the planned
    text, as (pieces kept, characters of the last kept piece, -1 for all of
    it, the stop string); None when no stop occurs.

    Linear in the text, whatever the stop strings' length: each block of
    pieces is searched once per stop, together with the previous text's last
    ``longest - 1`` characters (an occurrence that ends in the block starts
    no earlier), and a block is never shorter than that carried tail. An
    occurrence found ends in the current block; one that starts earlier ends
    at most ``longest`` characters later, so the scan goes on that far
    before it settles."""
    longest = max(len(s) for s in stops)
    size = max(_CUT_BLOCK, longest)
    carry = ""  # the text's last longest - 1 characters before `offset`
    offset = 0
    best: int | None = None
    matched = ""
    for pieces in _blocks(seed, count, size):
        window = carry + "".join(pieces)
        start = offset - len(carry)
        for stop in stops:
            at = window.find(stop)
            # At one start the shorter stop wins: a backend sees it complete first.
            if at >= 0 and (best is None or (start + at, len(stop)) < (best, len(matched))):
                best, matched = start + at, stop
        offset = start + len(window)
        if best is not None and offset >= best + longest:
            break
        carry = window[len(window) - longest + 1:] if longest > 1 else ""
    if best is None:
        return None
    # Replay to the piece holding `best`: it is cut, or dropped when it starts there.
    offset = kept = 0
    for pieces in _blocks(seed, count, size):
        if offset + sum(map(len, pieces)) <= best:
            offset += sum(map(len, pieces))
            kept += len(pieces)
            continue
        for piece in pieces:
            if offset + len(piece) > best:
                return (kept + 1, best - offset, matched) if best > offset else (kept, -1, matched)
            offset += len(piece)
            kept += 1
    return (count, -1, matched)  # not reached: best lies inside the text


def plan(api: Api, body: Mapping[str, Any], sim: SimulatorConfig,
         cap: int) -> TextPlan | GreedyPlan:
    """The answer to a request, as a lazy :class:`TextPlan`. ``cap`` (the
    model's ``max_output_tokens``) bounds its length whatever the body says:
    the edge rejects a larger limit, and a body that reached a worker some
    other way is still cut there, with ``"length"``."""
    dialect = apis.of(api)
    limit = dialect.output_cap(body)
    if sim.deterministic and dialect.continuable:
        chat = dialect.chat_body(body)  # Responses' input read as chat messages
        return greedy_plan(chat is not None, body if chat is None else chat,
                           None if limit is None else min(limit, cap), min(sim.length, cap))
    count = sim.length if limit is None else limit
    finish = "stop" if limit is None else "length"
    if count > cap:
        count, finish = cap, "length"
    return TextPlan(_seed(api, body), count, finish, _stops(api, body))


def plan_text(api: Api, body: Mapping[str, Any], sim: SimulatorConfig,
              cap: int = DEFAULT_MAX_OUTPUT_TOKENS) -> tuple[list[str], str]:
    """The pieces and the finish reason for a request, as a list (for tests
    and tools; the streams read the lazy :func:`plan`)."""
    text = plan(api, body, sim, cap)
    return list(text), text.finish


async def plan_off_loop(api: Api, body: Mapping[str, Any], sim: SimulatorConfig,
                        cap: int) -> TextPlan | GreedyPlan:
    """:func:`plan`, in a thread when there are stop strings to find: that
    reads the whole answer (up to ``cap`` tokens, tens of ms), longer than the
    worker's event loop may stop for. Without them planning is O(1)."""
    if _stops(api, body) and not sim.deterministic:
        return await asyncio.to_thread(plan, api, body, sim, cap)
    return plan(api, body, sim, cap)


def _usage_json(usage: Usage) -> bytes:
    p, c = usage.prompt_tokens, usage.completion_tokens
    return (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
            % (p, c, p + c))


class SimulatorStream(PacedStream):
    """One simulated chat or completions response.

    Streaming responses are a sequence of events indexed from 0 (paced as
    ``workers.backends.paced`` says): the chat role chunk (chat only), one
    content chunk per token, the finish chunk, and the usage chunk when the
    client asked ``include_usage``.
    """

    __slots__ = ("_head", "_suffix", "_tail", "_tok_prefix")

    def __init__(self, request: Request, sim: SimulatorConfig, now: float,
                 cap: int = DEFAULT_MAX_OUTPUT_TOKENS,
                 pieces: TextPlan | GreedyPlan | None = None) -> None:
        if pieces is None:
            pieces = plan(request.api, request.body, sim, cap)
        chat = apis.of(request.api).openai_chat
        first_tok = 1 if chat else 0
        # role (chat) + tokens + finish + usage (when asked)
        super().__init__(request, pieces, pieces.finish,
                         Usage(prompt_tokens=estimate_prompt_tokens(request.api, request.body)),
                         now + sim.ttft, 1.0 / sim.tokens_per_second, first_tok,
                         first_tok + len(pieces) + 1 + (1 if request.include_usage else 0))
        ident = ("chatcmpl-" if chat else "cmpl-") + request.id
        if chat:
            obj = b"chat.completion.chunk" if request.stream else b"chat.completion"
        else:
            obj = b"text_completion"
        self._head = (b'{"id":' + json.dumps(ident).encode() + b',"object":"' + obj
                      + b'","created":%d,"model":' % (request.created_ms // 1000)
                      + json.dumps(request.model).encode() + b',"choices":[')
        self._tail = b',"usage":null' if request.include_usage and request.stream else b""
        if chat:
            self._tok_prefix = b"data: " + self._head + b'{"index":0,"delta":{"content":'
            self._suffix = (b'},"logprobs":null,"finish_reason":null}]' + self._tail
                            + b"}\n\n")
        else:
            self._tok_prefix = b"data: " + self._head + b'{"text":'
            self._suffix = (b',"index":0,"logprobs":null,"finish_reason":null}]' + self._tail
                            + b"}\n\n")

    def _event(self, index: int) -> bytes:
        """Bytes of streaming event ``index`` (pure; :meth:`_account` counts it once sent)."""
        token = index - self._first_tok
        if 0 <= token < self._n:
            piece = self._pieces[token]
            encoded = _PIECE_JSON.get(piece) or json.dumps(piece).encode()
            return self._tok_prefix + encoded + self._suffix
        if token < 0:
            return (b"data: " + self._head
                    + b'{"index":0,"delta":{"role":"assistant","content":""},'
                      b'"logprobs":null,"finish_reason":null}]' + self._tail + b"}\n\n")
        if token == self._n:
            reason = self._usage_finish.encode()
            if self._first_tok:
                choice = b'{"index":0,"delta":{},"logprobs":null,"finish_reason":"%s"}' % reason
            else:
                choice = b'{"text":"","index":0,"logprobs":null,"finish_reason":"%s"}' % reason
            return b"data: " + self._head + choice + b"]" + self._tail + b"}\n\n"
        u = self._usage
        cost = cost_member(self._request.extra.get(PRICE_EXTRA), u.prompt_tokens,
                           u.completion_tokens, u.cached_tokens)
        return b"data: " + self._head + b'],"usage":' + _usage_json(u) + cost + b"}\n\n"

    def _account(self, index: int) -> None:
        token = index - self._first_tok
        if 0 <= token < self._n:
            self._usage.completion_tokens += 1
        elif token == self._n:
            self._usage.finish_reason = self._usage_finish

    def _final_body(self) -> bytes:
        text = json.dumps("".join(self._pieces)).encode()
        reason = self._usage_finish.encode()
        if apis.of(self._request.api).openai_chat:
            choice = (b'{"index":0,"message":{"role":"assistant","content":' + text
                      + b',"refusal":null},"logprobs":null,"finish_reason":"%s"}' % reason)
        else:
            choice = (b'{"text":' + text
                      + b',"index":0,"logprobs":null,"finish_reason":"%s"}' % reason)
        return self._head + choice + b'],"usage":' + _usage_json(self._usage) + b"}"


class SimulatorBackend:
    """Implements :class:`workers.backends.Backend` with :class:`SimulatorStream`.

    Stateless apart from the model and worker config; ``open`` fails only
    for an embeddings request over ``simulator_responses.MAX_DIMENSIONS`` or
    whose response could outgrow ``worker.max_response_bytes``. Responses and
    embeddings are ``workers.backends.simulator_responses``.
    """

    def __init__(self, model: ModelConfig, worker: WorkerConfig | None = None) -> None:
        self._model = model
        self._worker = worker or WorkerConfig()
        # One cache per backend object, i.e. per worker process and replica:
        # what one GPU's KV cache holds.
        self._cache = PrefixCache()

    async def open(self, request: Request) -> BackendStream:
        sim = self._model.simulator
        cap = self._model.max_output_tokens
        now = time.monotonic()
        dialect = apis.of(request.api)
        if dialect.anthropic:  # translated to chat and back (messages_sim)
            return await simulated_messages(request, sim, cap)
        if dialect.vectors:
            return await SimulatorEmbeddings.open(request, sim, now,
                                                  self._worker.max_response_bytes)
        if (dialect.openai_chat or dialect.typed_events) and wants_tool_call(request.body, sim):
            if dialect.typed_events:  # Responses (Messages went above)
                return SimulatorResponsesToolCall(request, sim, now)
            return SimulatorToolCall(request, sim, now)
        pieces = await plan_off_loop(request.api, request.body, sim, cap)
        if dialect.typed_events:  # Responses (Messages went above)
            return SimulatorResponsesStream(request, pieces, pieces.finish, sim, now)
        if sim.prefill_per_char > 0:
            cached, total = self._cache.lookup(prompt_text(request.body, dialect.openai_chat))
            now += sim.prefill_per_char * (total - cached)
        return SimulatorStream(request, sim, now, cap, pieces)

    async def aclose(self) -> None:
        return None


async def simulated_messages(request: Request, sim: SimulatorConfig,
                             cap: int) -> BackendStream:
    """POST /v1/messages on the simulator: its chat answer to the translated
    request, translated back (``workers.backends.messages_sim``)."""
    from workers.backends.messages_sim import TranslatedStream
    now = time.monotonic()
    chat = TranslatedStream.chat_request(request, sim.length)
    if wants_tool_call(chat.body, sim):
        return TranslatedStream(request, SimulatorToolCall(chat, sim, now))
    planned = await plan_off_loop(chat.api, chat.body, sim, cap)
    # A greedy plan applies no stop strings (workers/backends/greedy.py).
    stopped_by = planned.stopped_by if isinstance(planned, TextPlan) else ""
    return TranslatedStream(request, SimulatorStream(chat, sim, now, cap, planned),
                            stopped_by)
