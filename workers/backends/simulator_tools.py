"""The simulator's tool call (test only): with ``simulator.tool_call`` set to a
tool's name, a chat or Messages request that lists that tool, and whose last
turn is not a tool's result, is answered with one call of it, arguments
``simulator.tool_arguments``, ``finish_reason: "tool_calls"`` (``tool_use``
in Messages). The request after the result gets the usual text, so a client's
tool loop (Claude Code's: tool_use, run the tool, tool_result, text) runs
against the simulator. docs/configuration.md, ``[models.simulator]``.

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

__all__ = ["SimulatorToolCall", "wants_tool_call"]

# Characters of the arguments per streamed piece: a few pieces, so a client's
# partial-JSON assembly (input_json_delta) is exercised.
_PIECE = 16


def wants_tool_call(body: Mapping[str, Any], sim: SimulatorConfig) -> bool:
    """Whether the simulator answers this chat body with a call of ``sim.tool_call``."""
    if not sim.tool_call:
        return False
    messages = body.get("messages")
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not isinstance(last, dict) or last.get("role") == "tool":
        return False
    tools = body.get("tools")
    return any(isinstance(t, dict) and isinstance(t.get("function"), dict)
               and t["function"].get("name") == sim.tool_call
               for t in (tools if isinstance(tools, list) else ()))


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
