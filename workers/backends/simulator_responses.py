"""The simulator's Responses API and embeddings, in OpenAI's wire format.

Same invariants as ``workers.backends.simulator``, for the two newer endpoints:

* Responses, streaming: OpenAI's typed events in OpenAI's order, ``sequence_number``
  without a gap, ending with ``response.completed`` (or ``response.incomplete``
  when ``max_output_tokens`` cut it); no ``data: [DONE]``.
* Responses, not streaming: the final response object, at the last token.
* Embeddings: per input, a unit float32 vector of ``dimensions``, a pure
  function of the input and model name; usage is the token estimate; a
  response that could outgrow ``worker.max_response_bytes`` is refused first,
  and the body is built in a thread.
"""

from __future__ import annotations

import array
import asyncio
import base64
import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from tidegate.apis import estimate_prompt_tokens
from tidegate.config import SimulatorConfig
from tidegate.errors import ApiError, BackendError
from tidegate.validation.responses import check_embeddings_size, embedding_inputs
from tidegate.wire.protocol import Request
from workers.backends.base import Usage
from workers.backends.paced import PacedStream

__all__ = ["MAX_DIMENSIONS", "SimulatorEmbeddings", "SimulatorResponsesStream", "embed",
           "response_object"]

MAX_DIMENSIONS = 8192  # a bigger request would only cost the worker memory

_OPENING = 4  # created, in_progress, output_item.added, content_part.added
_CLOSING = 4  # output_text.done, content_part.done, output_item.done, completed


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def response_id(request: Request) -> str:
    """The simulated response's id (a function of the request's)."""
    return "resp_" + request.id


def response_usage(request: Request) -> Usage:
    """A simulated response's usage before its first token: the prompt
    estimate, and the id (workers.owners records it)."""
    return Usage(prompt_tokens=estimate_prompt_tokens(request.api, request.body),
                 response_id=response_id(request))


def response_object(request: Request, status: str, output: list[dict[str, Any]] | None,
                    usage: Usage | None) -> dict[str, Any]:
    """The Responses API's response object for ``request``, as OpenAI writes it."""
    body = request.body
    incomplete = status == "incomplete"
    return {
        "id": response_id(request), "object": "response",
        "created_at": request.created_ms // 1000, "status": status, "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": request.model, "output": output or [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature", 1.0),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"), "tools": body.get("tools") or [],
        "top_p": body.get("top_p", 1.0), "truncation": body.get("truncation", "disabled"),
        "usage": None if usage is None else {
            "input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens},
        "metadata": body.get("metadata") or {},
    }


class SimulatorResponsesStream(PacedStream):
    """One simulated Responses API answer: its opening events, one
    ``response.output_text.delta`` per token, its closing events (paced as
    ``workers.backends.paced`` says; the first two are due at once)."""

    __slots__ = ("_delta_prefix", "_item_id", "_status", "_t_open", "_text")

    def __init__(self, request: Request, pieces: Sequence[str], finish: str, sim: SimulatorConfig,
                 now: float) -> None:
        # plan_text says "length" exactly when max_output_tokens bounded the text.
        super().__init__(request, pieces, finish, response_usage(request),
                         now + sim.ttft, 1.0 / sim.tokens_per_second, _OPENING,
                         _OPENING + len(pieces) + _CLOSING)
        self._status = "incomplete" if finish == "length" else "completed"
        self._t_open = now
        self._item_id = "msg_" + request.id
        self._delta_prefix = (b',"item_id":"' + self._item_id.encode()
                              + b'","output_index":0,"content_index":0,"delta":')
        self._text = ""  # the whole text, once the closing events need it (_prepare)

    # -- the response object -------------------------------------------------------

    def _response(self, status: str, output: list[dict[str, Any]] | None,
                  usage: Usage | None) -> dict[str, Any]:
        return response_object(self._request, status, output, usage)

    def _part(self, text: str) -> dict[str, Any]:
        return {"type": "output_text", "annotations": [], "logprobs": [], "text": text}

    def _item(self, status: str, text: str | None) -> dict[str, Any]:
        return {"id": self._item_id, "type": "message", "status": status,
                "content": [] if text is None else [self._part(text)], "role": "assistant"}

    # -- streaming -------------------------------------------------------------------

    def _due(self, index: int) -> float:
        if index < 2:
            return self._t_open
        return super()._due(index)

    def _event(self, index: int) -> bytes:
        """Bytes of event ``index`` (pure; ``_account`` counts it once sent)."""
        token = index - _OPENING
        if 0 <= token < self._n:
            # Per token: only the piece is encoded; the rest is prebuilt.
            return (b'event: response.output_text.delta\ndata: {"type":'
                    b'"response.output_text.delta","sequence_number":%d' % index
                    + self._delta_prefix + _json(self._pieces[token])
                    + b',"logprobs":[]}\n\n')
        text = self._text
        ident: dict[str, Any] = {"item_id": self._item_id, "output_index": 0}
        obj: dict[str, Any]
        if index == 0:
            kind, obj = "response.created", {"response": self._response("in_progress", [], None)}
        elif index == 1:
            kind, obj = "response.in_progress", {
                "response": self._response("in_progress", [], None)}
        elif index == 2:
            kind, obj = "response.output_item.added", {
                "output_index": 0, "item": self._item("in_progress", None)}
        elif index == 3:
            kind, obj = "response.content_part.added", {
                **ident, "content_index": 0, "part": self._part("")}
        elif token == self._n:
            kind, obj = "response.output_text.done", {
                **ident, "content_index": 0, "text": text, "logprobs": []}
        elif token == self._n + 1:
            kind, obj = "response.content_part.done", {
                **ident, "content_index": 0, "part": self._part(text)}
        elif token == self._n + 2:
            kind, obj = "response.output_item.done", {
                "output_index": 0, "item": self._item("completed", text)}
        else:
            kind = "response." + self._status
            obj = {"response": self._response(self._status, [self._item("completed", text)],
                                              self._usage)}
        payload = _json({"type": kind, "sequence_number": index, **obj})
        return b"event: " + kind.encode() + b"\ndata: " + payload + b"\n\n"

    async def _prepare(self, now: float) -> None:
        # The closing events are due with the last token and carry the whole text.
        if not self._text and self._n and self._due(_OPENING + self._n - 1) <= now:
            self._text = await asyncio.to_thread("".join, self._pieces)

    def _account(self, index: int) -> None:
        token = index - _OPENING
        if 0 <= token < self._n:
            self._usage.completion_tokens += 1
        elif token == self._n + _CLOSING - 1:
            self._usage.finish_reason = self._usage_finish

    def _final_body(self) -> bytes:
        text = "".join(self._pieces)
        return _json(self._response(self._status, [self._item("completed", text)],
                                    self._usage))


def embed(item: str | list[int], model: str, dimensions: int) -> list[float]:
    """The simulator's vector for one input: unit length, float32 values
    (exact in JSON and in base64), a pure function of its arguments."""
    seed = hashlib.blake2b(_json([model, item]), digest_size=8).digest()
    rng = random.Random(int.from_bytes(seed, "big"))
    values = [rng.gauss(0.0, 1.0) for _ in range(dimensions)]
    norm = math.sqrt(sum(v * v for v in values)) or 1.0
    return array.array("f", [v / norm for v in values]).tolist()


def embeddings_body(model: str, inputs: Sequence[str | list[int]], dimensions: int,
                    b64: bool, tokens: int) -> bytes:
    """The response body, built one vector at a time: what it holds beyond
    the body is one vector, not a list of every float."""
    parts = [b'{"object":"list","data":[']
    for index, item in enumerate(inputs):
        vector = embed(item, model, dimensions)
        if b64:
            packed = array.array("f", vector)
            if sys.byteorder != "little":
                packed.byteswap()
            encoded = b'"' + base64.b64encode(packed.tobytes()) + b'"'
        else:
            encoded = _json(vector)
        parts.append(b'%s{"object":"embedding","index":%d,"embedding":%s}'
                     % (b"," if index else b"", index, encoded))
    parts.append(b'],"model":%s,"usage":{"prompt_tokens":%d,"total_tokens":%d}}'
                 % (_json(model), tokens, tokens))
    return b"".join(parts)


class SimulatorEmbeddings:
    """One simulated embeddings answer (a JSON body). Implements ``BackendStream``.

    :meth:`open` bounds the request before any vector is made (dimensions
    by :data:`MAX_DIMENSIONS`, the response by the worker's
    ``max_response_bytes``) and builds the body in a thread: at that bound it
    takes a second of CPU, which the event loop must not wait for.
    """

    __slots__ = ("_body", "_offset", "_ready_at", "_request", "_usage")

    def __init__(self, request: Request, body: bytes, usage: Usage, ready_at: float) -> None:
        self._request = request
        self._body = body
        self._usage = usage
        self._ready_at = ready_at
        self._offset = 0

    @classmethod
    async def open(cls, request: Request, sim: SimulatorConfig, now: float,
                   max_response_bytes: int) -> SimulatorEmbeddings:
        body = request.body
        dims = body.get("dimensions")
        dimensions = dims if isinstance(dims, int) else sim.embedding_dimensions
        if dimensions > MAX_DIMENSIONS:
            raise BackendError(400, f"The simulator makes vectors of at most {MAX_DIMENSIONS} "
                               f"dimensions, not {dimensions}.", type="invalid_request_error",
                               code="invalid_value")
        try:  # the edge checked this against its own cap; a worker's may be smaller
            check_embeddings_size(body, dimensions, max_response_bytes,
                                  "worker.max_response_bytes")
        except ApiError as error:
            raise BackendError(400, error.message, type="invalid_request_error",
                               code="invalid_value") from None
        usage = Usage(prompt_tokens=estimate_prompt_tokens(request.api, body),
                      finish_reason="stop")
        raw = await asyncio.to_thread(embeddings_body, request.model, embedding_inputs(body),
                                      dimensions, body.get("encoding_format") == "base64",
                                      usage.prompt_tokens)
        return cls(request, raw, usage, now + sim.ttft)

    @property
    def usage(self) -> Usage:
        return self._usage

    async def read(self, max_bytes: int) -> bytes:
        delay = self._ready_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        start = self._offset
        self._offset = min(len(self._body), start + max(1, max_bytes))
        return self._body[start:self._offset]

    async def aclose(self) -> None:
        self._offset = len(self._body)
