"""Anthropic Messages requests as chat completions, and chat completions back
as Messages (sans-I/O): the translation mode of ``POST /v1/messages``.

:func:`to_chat`: ``system`` and every system turn fold into one first system
message; content blocks become chat content (``tool_use`` as ``tool_calls``,
``tool_result`` as ``tool`` messages, ``thinking`` dropped); tools, stop
sequences, ``metadata.user_id`` and the output format map to chat fields.
Hints are dropped; what changes the answer and has no chat equivalent is a 400
naming it; other unknown fields pass on. :func:`to_message`: a chat completion
as a Messages body. Each field's fate: docs/anthropic.md#request-fields.
"""

from __future__ import annotations

import json
from typing import Any

from tidegate.errors import BackendError
from tidegate.wire.anthropic import STOP_REASONS

__all__ = ["to_chat", "to_message", "tool_input"]

# Translated here (or tidegate's own); everything else not dropped passes on.
_HANDLED = frozenset({"model", "messages", "system", "max_tokens", "stop_sequences",
                      "stream", "tools", "tool_choice", "metadata", "temperature", "top_p",
                      "top_k", "context_management", "output_config", "output_format",
                      "mcp_servers", "container"})
# Anthropic-only annotations and hints: a chat backend would reject or misread
# them, and dropping them changes no answer a chat model can give
# (docs/anthropic.md says why for each).
_DROPPED = frozenset({"thinking", "service_tier", "anthropic_version", "betas",
                      "cache_control", "inference_geo"})


def _unsupported(what: str, param: str) -> BackendError:
    return BackendError(400, f"{what} cannot be translated to chat/completions for this "
                             f"model (docs/anthropic.md).", type="invalid_request_error",
                        code="unsupported_value", param=param)


def to_chat(body: dict[str, Any], model: str, *, stream: bool) -> dict[str, Any]:
    """The chat/completions body for a validated Messages body."""
    out: dict[str, Any] = {"model": model}
    _refuse_server_side(body)
    messages: list[dict[str, Any]] = []
    turns = body.get("messages") or ()
    # Chat templates (Qwen's, Llama's) take one system message, and first. A
    # system turn's instructions apply from its place on; at the front they
    # still cover every turn they applied to.
    system = [_system_text(body.get("system"))]
    system += [_system_text(t.get("content")) for t in turns if t.get("role") == "system"]
    text = "\n\n".join(s for s in system if s)
    if text:
        messages.append({"role": "system", "content": text})
    for i, turn in enumerate(turns):
        if turn.get("role") != "system":
            messages.extend(_turn(turn, f"messages[{i}]"))
    out["messages"] = messages
    response_format = _response_format(body)
    if response_format is not None:
        out["response_format"] = response_format
    out["max_tokens"] = body.get("max_tokens")
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    tools = body.get("tools")
    if tools:
        out["tools"] = [_tool(t, f"tools[{i}]") for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            out["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            out["tool_choice"] = "required" if kind == "any" else kind
        if choice.get("disable_parallel_tool_use") is True and tools:
            out["parallel_tool_calls"] = False
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        out["user"] = metadata["user_id"]
    for key, value in body.items():
        if key not in _HANDLED and key not in _DROPPED and key not in out:
            out[key] = value
    out["stream"] = stream
    if stream:
        out["stream_options"] = {"include_usage": True}
    return out


def _system_text(system: Any) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(b.get("text", "") for b in system if isinstance(b, dict)) \
        if isinstance(system, list) else ""


def _refuse_server_side(body: dict[str, Any]) -> None:
    """A 400 for what Anthropic's servers do beside the model and a chat
    backend cannot: MCP connectors, a code container, context edits other
    than clearing thinking (a chat backend is never sent thinking)."""
    if body.get("mcp_servers"):
        raise _unsupported("'mcp_servers' (MCP connectors run by Anthropic's API)",
                           "mcp_servers")
    if body.get("container") is not None:
        raise _unsupported("'container' (a code execution container)", "container")
    management = body.get("context_management")
    edits = management.get("edits") if isinstance(management, dict) else None
    for i, edit in enumerate(edits if isinstance(edits, list) else ()):
        kind = str(edit.get("type", ""))
        if not kind.startswith("clear_thinking_"):
            raise _unsupported(f"The context edit '{kind}'", f"context_management.edits[{i}]")


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``output_config.format`` (or the older top-level ``output_format``) as
    chat's ``response_format``: a JSON schema is one either way."""
    config = body.get("output_config")
    param = "output_config.format"
    wanted = config.get("format") if isinstance(config, dict) else None
    if wanted is None:
        wanted, param = body.get("output_format"), "output_format"
    if wanted is None:
        return None
    if not isinstance(wanted, dict) or wanted.get("type") != "json_schema" \
            or not isinstance(wanted.get("schema"), dict):
        raise _unsupported(f"'{param}' other than a json_schema with a 'schema' object", param)
    return {"type": "json_schema",
            "json_schema": {"name": "output", "schema": wanted["schema"], "strict": True}}


def _turn(turn: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role, content = turn.get("role"), turn.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = content if isinstance(content, list) else []
    if role == "assistant":
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            kind = block.get("type")
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use":
                calls.append({"id": block.get("id"), "type": "function", "function": {
                    "name": block.get("name"),
                    "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind not in ("thinking", "redacted_thinking"):
                raise _unsupported(f"A '{kind}' block in an assistant turn",
                                   f"{where}.content[{j}]")
        message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            message["tool_calls"] = calls
        return [message]
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": block.get("text", "")})
        elif kind == "image":
            parts.append(_image(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": _result_text(block, f"{where}.content[{j}]")})
        else:
            raise _unsupported(f"A '{kind}' block", f"{where}.content[{j}]")
    if parts:
        only_text = all(p["type"] == "text" for p in parts)
        out.append({"role": "user", "content": "".join(p["text"] for p in parts)
                    if only_text else parts})
    return out


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    source = block.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64":
            url = f"data:{source.get('media_type')};base64,{source.get('data')}"
            return {"type": "image_url", "image_url": {"url": url}}
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise _unsupported("An image whose source is not base64 or a URL", where)


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content")
    if content is None or isinstance(content, str):
        text = content or ""
    else:
        pieces = []
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") != "text":
                raise _unsupported("A tool_result part other than text", where)
            pieces.append(str(part.get("text", "")))
        text = "\n".join(pieces)
    return f"Error: {text}" if block.get("is_error") is True else text


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise _unsupported(f"The server tool '{kind}'", where)
    function: dict[str, Any] = {"name": tool.get("name"),
                                "parameters": tool.get("input_schema") or {"type": "object"}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if isinstance(tool.get("strict"), bool):
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def tool_input(arguments: Any) -> Any:
    """A tool call's ``arguments`` (a JSON text) as a ``tool_use`` block's input."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        value = json.loads(arguments)
    except ValueError:
        return {"_raw_arguments": arguments}  # the model wrote no JSON: keep what it wrote
    return value if isinstance(value, dict) else {"value": value}


def stop_reason(finish: str, matched: Any) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a choice: vLLM names the stop string
    it matched in the choice's ``stop_reason``."""
    if finish == "stop" and isinstance(matched, str) and matched:
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def to_message(obj: dict[str, Any], message_id: str, model: str) -> dict[str, Any]:
    """A chat completion body as a Messages body (``model``: the client's name)."""
    choices = obj.get("choices")
    head = choices[0] if isinstance(choices, list) and choices else None
    first: dict[str, Any] = head if isinstance(head, dict) else {}
    found = first.get("message")
    message: dict[str, Any] = found if isinstance(found, dict) else {}
    content: list[dict[str, Any]] = []
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    for n, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            content.append({"type": "tool_use", "id": call.get("id") or f"toolu_{message_id}_{n}",
                            "name": function.get("name"),
                            "input": tool_input(function.get("arguments"))})
    reason, sequence = stop_reason(str(first.get("finish_reason") or "stop"),
                                   first.get("stop_reason"))
    reported = obj.get("usage")
    usage: dict[str, Any] = reported if isinstance(reported, dict) else {}
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": int(usage.get("prompt_tokens") or 0),
                      "output_tokens": int(usage.get("completion_tokens") or 0)}}
