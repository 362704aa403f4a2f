"""The built-in model: deterministic text at a configured pace, in OpenAI's wire format.

The simulator lets the whole pipeline (edge, broker, dispatcher, workers) run
and be benchmarked without a GPU. Its output is byte-for-byte what the OpenAI
API sends, so the official ``openai`` SDK parses it.

Invariants:

* **Deterministic.** The text depends only on the prompt (and the body's
  ``seed``): a seeded generator picks words from a fixed list, so the same
  request always gets the same text. Tests and benchmarks can compare runs.
* **Paced like a model.** Token ``i`` (0-based) is due ``ttft + i /
  tokens_per_second`` seconds after :meth:`SimulatorBackend.open`. Time runs
  whether or not anyone reads: a reader that falls behind gets every due token
  at once (coalesced, as consecutive complete SSE events, up to ``max_bytes``),
  the way a real backend's socket buffer fills while the worker is paused.
* **Length.** Without ``max_tokens`` (``max_completion_tokens`` for chat) the
  simulator writes ``simulator.length`` tokens and finishes with ``"stop"``, as
  a model does when it chooses to end. With it, exactly that many tokens and
  ``"length"``. A ``stop`` string ends the text *before* the string, with
  ``"stop"``; the token in which it starts counts as generated.
* **Hot path.** Each stream prebuilds its event prefix/suffix bytes once; per
  token only the token text is JSON-encoded (and common words come from a
  cache), so no per-token dict is built or serialised.

Only one choice is generated (``n`` is ignored).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Mapping
from typing import Any

from tidegate.config import ModelConfig, SimulatorConfig
from tidegate.wire.protocol import Api, Request
from tidegate.wire.tokens import estimate_prompt_tokens
from workers.backends import BackendStream, Usage
from workers.backends.prefix_cache import PrefixCache, prompt_text
from workers.backends.simulator_responses import SimulatorEmbeddings, SimulatorResponsesStream

__all__ = ["SimulatorBackend", "SimulatorStream", "plan_text"]

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


def _limit(api: Api, body: Mapping[str, Any]) -> int | None:
    """The client's token limit; the smaller one when both names are given."""
    names = (("max_tokens", "max_completion_tokens") if api == Api.CHAT else
             ("max_output_tokens",) if api == Api.RESPONSES else ("max_tokens",))
    limits = [v for n in names
              if isinstance(v := body.get(n), int) and not isinstance(v, bool)]
    return max(0, min(limits)) if limits else None


def _stops(body: Mapping[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        return []
    return [s for s in stop if isinstance(s, str) and s]


def _seed(api: Api, body: Mapping[str, Any]) -> int:
    material = {
        "prompt": body.get("messages") if api == Api.CHAT else body.get("prompt"),
        "seed": body.get("seed"),
    }
    if api == Api.RESPONSES:
        material = {"prompt": body.get("input"), "instructions": body.get("instructions")}
    raw = json.dumps(material, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def plan_text(api: Api, body: Mapping[str, Any], sim: SimulatorConfig) -> tuple[list[str], str]:
    """The pieces (one per emitted token) and the finish reason for a request.

    Pure function of the body and the simulator config; the stream only paces it.
    """
    limit = _limit(api, body)
    count = sim.length if limit is None else limit
    finish = "stop" if limit is None else "length"
    rng = random.Random(_seed(api, body))
    words = rng.choices(_WORDS, k=count)
    pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
    stops = _stops(body)
    if stops and pieces:
        text = "".join(pieces)
        hits = [i for i in (text.find(s) for s in stops) if i >= 0]
        if hits:
            cut = min(hits)
            kept: list[str] = []
            offset = 0
            for piece in pieces:
                if offset + len(piece) > cut:
                    if cut > offset:
                        kept.append(piece[: cut - offset])
                    break
                kept.append(piece)
                offset += len(piece)
            return kept, "stop"
    return pieces, finish


def _usage_json(usage: Usage) -> bytes:
    p, c = usage.prompt_tokens, usage.completion_tokens
    return (b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}'
            % (p, c, p + c))


class SimulatorStream:
    """One simulated response. Implements :class:`workers.backends.BackendStream`.

    Streaming responses are a sequence of events indexed from 0: the chat role
    chunk (chat only), one content chunk per token, the finish chunk, and the
    usage chunk when the client asked ``include_usage``. Event ``k`` is due
    when the token it carries (or the last token, for finish/usage; the first,
    for the role chunk) is due.
    """

    __slots__ = (
        "_body", "_closed", "_first_tok", "_head", "_interval", "_n", "_next", "_offset",
        "_pieces", "_request", "_suffix", "_t_first", "_tail", "_tok_prefix", "_total",
        "_usage", "_usage_finish",
    )

    def __init__(self, request: Request, sim: SimulatorConfig, now: float) -> None:
        self._request = request
        pieces, finish = plan_text(request.api, request.body, sim)
        self._pieces = pieces
        self._n = len(pieces)
        self._usage = Usage(prompt_tokens=estimate_prompt_tokens(request.api, request.body))
        self._usage_finish = finish
        self._t_first = now + sim.ttft
        self._interval = 1.0 / sim.tokens_per_second
        self._next = 0
        self._closed = False
        self._body: bytes | None = None
        self._offset = 0
        chat = request.api == Api.CHAT
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
        self._first_tok = 1 if chat else 0
        # role (chat) + tokens + finish + usage (when asked)
        self._total = (self._first_tok + self._n + 1
                       + (1 if request.include_usage else 0)) if request.stream else 0

    @property
    def usage(self) -> Usage:
        return self._usage

    def _due(self, index: int) -> float:
        token = min(max(index - self._first_tok, 0), max(self._n - 1, 0))
        return self._t_first + token * self._interval

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
        return b"data: " + self._head + b'],"usage":' + _usage_json(self._usage) + b"}\n\n"

    def _account(self, index: int) -> None:
        token = index - self._first_tok
        if 0 <= token < self._n:
            self._usage.completion_tokens += 1
        elif token == self._n:
            self._usage.finish_reason = self._usage_finish

    async def read(self, max_bytes: int) -> bytes:
        if self._closed:
            return b""
        if not self._request.stream:
            return await self._read_body(max_bytes)
        index = self._next
        if index >= self._total:
            return b""
        due = self._due(index)
        now = time.monotonic()
        if due > now:
            await asyncio.sleep(due - now)
            # The event we slept for is due even if the loop woke a hair early.
            now = max(time.monotonic(), due)
        # Finish and usage events must see the final completion count, so each
        # event is accounted before the next one is built.
        self._account(index)
        parts = [self._event(index)]
        size = len(parts[0])
        index += 1
        while index < self._total and self._due(index) <= now:
            event = self._event(index)
            if size + len(event) > max_bytes:
                break
            self._account(index)
            parts.append(event)
            size += len(event)
            index += 1
        self._next = index
        return b"".join(parts)

    async def _read_body(self, max_bytes: int) -> bytes:
        if self._body is None:
            done_at = self._due(self._first_tok + self._n - 1 if self._n else 0)
            delay = done_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self._usage.completion_tokens = self._n
            self._usage.finish_reason = self._usage_finish
            self._body = self._final_body()
        if self._offset >= len(self._body):
            return b""
        end = self._offset + max(1, max_bytes)
        chunk = self._body[self._offset:end]
        self._offset = end
        return chunk

    def _final_body(self) -> bytes:
        text = json.dumps("".join(self._pieces)).encode()
        reason = self._usage_finish.encode()
        if self._request.api == Api.CHAT:
            choice = (b'{"index":0,"message":{"role":"assistant","content":' + text
                      + b',"refusal":null},"logprobs":null,"finish_reason":"%s"}' % reason)
        else:
            choice = (b'{"text":' + text
                      + b',"index":0,"logprobs":null,"finish_reason":"%s"}' % reason)
        return self._head + choice + b'],"usage":' + _usage_json(self._usage) + b"}"

    async def aclose(self) -> None:
        """End the stream. Idempotent.

        A response closed before its end counts every token the simulated
        model had generated by now (it runs at its pace whether read or not),
        which is at least what was read; ``finish_reason`` stays empty.
        """
        if self._closed:
            return
        self._closed = True
        finished = (self._body is not None if not self._request.stream
                    else self._next >= self._total)
        if finished:
            return
        elapsed = time.monotonic() - self._t_first
        due = 0 if elapsed < 0 else min(self._n, int(elapsed / self._interval) + 1)
        self._usage.completion_tokens = max(self._usage.completion_tokens, due)


class SimulatorBackend:
    """Implements :class:`workers.backends.Backend` with :class:`SimulatorStream`.

    Stateless apart from the model config; ``open`` fails only for an
    embeddings request over ``simulator_responses.MAX_DIMENSIONS``. Responses
    and embeddings are ``workers.backends.simulator_responses``.
    """

    def __init__(self, model: ModelConfig) -> None:
        self._model = model
        # One cache per backend object, i.e. per worker process and replica:
        # what one GPU's KV cache holds.
        self._cache = PrefixCache()

    async def open(self, request: Request) -> BackendStream:
        sim = self._model.simulator
        if sim.prefill_per_char > 0 and request.api in (Api.CHAT, Api.COMPLETIONS):
            cached, total = self._cache.lookup(prompt_text(request.body,
                                                           request.api == Api.CHAT))
            prefill = sim.prefill_per_char * (total - cached)
            return SimulatorStream(request, sim, time.monotonic() + prefill)
        if request.api == Api.RESPONSES:
            pieces, finish = plan_text(request.api, request.body, sim)
            return SimulatorResponsesStream(request, pieces, finish, sim, time.monotonic())
        if request.api == Api.EMBEDDINGS:
            return SimulatorEmbeddings(request, sim, time.monotonic())
        return SimulatorStream(request, sim, time.monotonic())

    async def aclose(self) -> None:
        return None
