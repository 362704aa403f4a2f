"""The simulator's tool call (test only): with ``simulator.tool_call`` set to a
tool's name, a chat, Messages or Responses request that lists that tool, and
whose last turn is not a tool's result, is answered with one call of it,
arguments ``simulator.tool_arguments``, ``finish_reason: "tool_calls"``
(``tool_use`` in Messages, a ``function_call`` output item in Responses). The
request after the result gets the usual text, so a client's tool loop (Claude
Code's, an agent framework's: call, run the tool, result, text) runs against
the simulator. docs/configuration.md, ``[models.simulator]``.

The call is paced like text: the role and the call's name open it with the
first token, each piece of its arguments is a token.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tidegate.apis import estimate_prompt_tokens
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Request
from workers.backends.base import Usage
from workers.backends.paced import PacedStream
from workers.backends.simulator_responses import response_object, response_usage

__all__ = ["SimulatorResponsesToolCall", "SimulatorToolCall", "wants_tool_call"]

# Characters of the arguments per streamed piece: a few pieces, so a client's
# partial-JSON assembly (input_json_delta) is exercised.
_PIECE = 16


def wants_tool_call(body: Mapping[str, Any], sim: SimulatorConfig) -> bool:
    """Whether the simulator answers this chat or Responses body with a call
    of ``sim.tool_call``."""
    if not sim.tool_call:
        return False
    turns = body.get("messages", body.get("input"))
    last = turns[-1] if isinstance(turns, list) and turns else turns
    if isinstance(last, dict):
        if last.get("role") == "tool" or last.get("type") == "function_call_output":
            return False
    elif not isinstance(last, str):  # Responses' input may be one string
        return False
    tools = body.get("tools")
    return any(_tool_name(t) == sim.tool_call for t in (tools if isinstance(tools, list) else ()))


def _tool_name(tool: Any) -> Any:
    """A chat tool's name (under "function") or a Responses tool's (its own)."""
    if not isinstance(tool, dict):
        return None
    function = tool.get("function")
    return (function if isinstance(function, dict) else tool).get("name")


class SimulatorToolCall(PacedStream):
    """One simulated chat answer that is a tool call (events: role, the call's
    name, one per argument piece, finish, usage when asked)."""

    __slots__ = ("_call_id", "_head", "_name", "_tail")

    def __init__(self, request: Request, sim: SimulatorConfig, now: float) -> None:
        arguments = sim.tool_arguments
        pieces = [arguments[i:i + _PIECE] for i in range(0, len(arguments), _PIECE)] or [""]
        super().__init__(request, pieces, "tool_calls",
                         Usage(prompt_tokens=estimate_prompt_tokens(request.api, request.body)),
                         now + sim.ttft, 1.0 / sim.tokens_per_second, 2,
                         2 + len(pieces) + 1 + (1 if request.include_usage else 0))
        self._name = sim.tool_call
        self._call_id = "call_" + request.id
        obj = "chat.completion.chunk" if request.stream else "chat.completion"
        self._head = {"id": "chatcmpl-" + request.id, "object": obj,
                      "created": request.created_ms // 1000, "model": request.model}
        self._tail = {"usage": None} if request.include_usage else {}

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None) -> bytes:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None,
                                            "finish_reason": finish}]
        obj: dict[str, Any] = {**self._head, "choices": choices, **self._tail}
        if delta is None:
            u = self._usage
            obj["usage"] = {"prompt_tokens": u.prompt_tokens,
                            "completion_tokens": u.completion_tokens,
                            "total_tokens": u.prompt_tokens + u.completion_tokens}
        return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

    def _event(self, index: int) -> bytes:
        token = index - self._first_tok
        if index == 0:
            return self._chunk({"role": "assistant", "content": None})
        if index == 1:
            return self._chunk({"tool_calls": [{"index": 0, "id": self._call_id,
                                                "type": "function", "function": {
                                                    "name": self._name, "arguments": ""}}]})
        if token < self._n:
            return self._chunk({"tool_calls": [{"index": 0, "function": {
                "arguments": self._pieces[token]}}]})
        if token == self._n:
            return self._chunk({}, "tool_calls")
        return self._chunk(None)

    def _account(self, index: int) -> None:
        token = index - self._first_tok
        if 0 <= token < self._n:
            self._usage.completion_tokens += 1
        elif token == self._n:
            self._usage.finish_reason = self._usage_finish

    def _final_body(self) -> bytes:
        u = self._usage
        call = {"id": self._call_id, "type": "function",
                "function": {"name": self._name, "arguments": "".join(self._pieces)}}
        obj = {**self._head, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
            "logprobs": None, "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                      "total_tokens": u.prompt_tokens + u.completion_tokens}}
        return json.dumps(obj, separators=(",", ":")).encode()


class SimulatorResponsesToolCall(PacedStream):
    """One simulated Responses answer that is a function call (events:
    created, in_progress, the item added with the first token, one
    ``response.function_call_arguments.delta`` per argument piece, then the
    arguments done, the item done and ``response.completed``)."""

    __slots__ = ("_item",)

    def __init__(self, request: Request, sim: SimulatorConfig, now: float) -> None:
        arguments = sim.tool_arguments
        pieces = [arguments[i:i + _PIECE] for i in range(0, len(arguments), _PIECE)] or [""]
        super().__init__(request, pieces, "tool_calls", response_usage(request),
                         now + sim.ttft, 1.0 / sim.tokens_per_second, 3, 3 + len(pieces) + 3)
        self._item = {"id": "fc_" + request.id, "type": "function_call", "status": "in_progress",
                      "arguments": "", "call_id": "call_" + request.id, "name": sim.tool_call}

    def _done_item(self) -> dict[str, Any]:
        return {**self._item, "status": "completed", "arguments": "".join(self._pieces)}

    def _event(self, index: int) -> bytes:
        token = index - self._first_tok
        ident = {"item_id": self._item["id"], "output_index": 0}
        obj: dict[str, Any]
        if index < 2:
            kind = "response.created" if index == 0 else "response.in_progress"
            obj = {"response": response_object(self._request, "in_progress", [], None)}
        elif index == 2:
            kind, obj = "response.output_item.added", {"output_index": 0, "item": self._item}
        elif token < self._n:
            kind, obj = "response.function_call_arguments.delta", {
                **ident, "delta": self._pieces[token]}
        elif token == self._n:
            kind, obj = "response.function_call_arguments.done", {
                **ident, "name": self._item["name"], "arguments": "".join(self._pieces)}
        elif token == self._n + 1:
            kind, obj = "response.output_item.done", {"output_index": 0,
                                                      "item": self._done_item()}
        else:
            kind, obj = "response.completed", {"response": response_object(
                self._request, "completed", [self._done_item()], self._usage)}
        payload = json.dumps({"type": kind, "sequence_number": index, **obj},
                             separators=(",", ":"))
        return b"event: " + kind.encode() + b"\ndata: " + payload.encode() + b"\n\n"

    def _account(self, index: int) -> None:
        token = index - self._first_tok
        if 0 <= token < self._n:
            self._usage.completion_tokens += 1
        elif token == self._n + 2:
            self._usage.finish_reason = self._usage_finish

    def _final_body(self) -> bytes:
        obj = response_object(self._request, "completed", [self._done_item()], self._usage)
        return json.dumps(obj, separators=(",", ":")).encode()
