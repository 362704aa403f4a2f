"""Prompt-token estimates without a tokenizer, for quota reservations.

The dispatcher reserves ``prompt estimate + completion cap`` and reconciles
with the backend's reported usage afterwards, so the estimate only has to be
fast and roughly right; it is never billed.

Text is counted by character class (ASCII letter, digit, punctuation, newline,
2-, 3- and 4-byte UTF-8), each with its average cost in BPE tokens (the
``_LETTER`` ... ``_THREE_BYTE`` weights below), using only C-speed string
operations: a few microseconds for a 2 kB prompt. Chat adds ``_PER_MESSAGE``
per message and ``_REPLY_PRIMING``; an image counts ``_IMAGE_TOKENS``; tools
and schemas count as their JSON text. How the weights were fitted and how
close they come to cl100k, o200k and Llama 3: docs/quotas.md#the-token-estimate.
"""

from __future__ import annotations

import json
import math
import string
from collections.abc import Iterable, Mapping
from typing import Any

from tidegate.wire.protocol import Api

__all__ = ["completion_cap", "estimate_prompt_tokens", "estimate_text_tokens", "reservation"]

_PER_MESSAGE = 4
_PER_NAME = 1
_PER_TOOL_CALL = 3
_REPLY_PRIMING = 3
_IMAGE_TOKENS = 765

_LETTER, _DIGIT, _PUNCT, _NEWLINE = 0.2, 0.9, 0.45, 1.6
_TWO_BYTE, _THREE_BYTE = 0.45, 0.9  # a 4-byte character counts as 2 x 3-byte - 1 x 2-byte

_LETTERS = string.ascii_letters.encode()
_DIGITS = string.digits.encode()
# Everything that is not ASCII punctuation: deleting it leaves the punctuation.
_NOT_PUNCT = (string.ascii_letters + string.digits + string.whitespace).encode() + \
    bytes(range(128, 256))


def _text_cost(text: str) -> float:
    data = text.encode("utf-8", "surrogatepass")
    size = len(data)
    cost = (_LETTER * (size - len(data.translate(None, _LETTERS)))
            + _DIGIT * (size - len(data.translate(None, _DIGITS)))
            + _PUNCT * len(data.translate(None, _NOT_PUNCT))
            + _NEWLINE * text.count("\n"))
    if size != len(text):
        non_ascii = len(text) - len(text.encode("ascii", "ignore"))
        # every non-ASCII character is 2, 3 or 4 bytes; treating 4-byte ones as
        # two 3-byte minus one 2-byte keeps two unknowns for two equations
        three = size - (len(text) - non_ascii) - 2 * non_ascii
        cost += _TWO_BYTE * (non_ascii - three) + _THREE_BYTE * three
    return cost


def estimate_text_tokens(text: str) -> int:
    """Estimated tokens of one text (see the module docstring for its error)."""
    return math.ceil(_text_cost(text)) if text else 0


def estimate_prompt_tokens(api: Api, body: Mapping[str, Any]) -> int:
    """Estimated prompt tokens of a chat, completions, responses or embeddings body.

    Chat: framing per message, each message's text content and name, tool
    calls, image parts, and the tool / response-format definitions.
    Completions: ``prompt`` as a string, a list of strings, or token arrays
    (each integer is one token), plus ``suffix``. Responses: ``instructions``,
    ``input`` (a text or items, messages costed as chat's) and tools.
    Embeddings: ``input`` as completions' ``prompt``, without framing.
    """
    cost = 0.0
    if api == Api.RESPONSES:
        return math.ceil(_responses_cost(body))
    if api == Api.MESSAGES:
        return math.ceil(_messages_cost(body))
    if api == Api.EMBEDDINGS:
        return math.ceil(sum(_text_cost(p) if isinstance(p, str) else len(p)
                             for p in _prompts(body.get("input"))))
    if api == Api.CHAT:
        messages = body.get("messages")
        for message in messages if isinstance(messages, list) else ():
            if isinstance(message, Mapping):
                cost += _message_cost(message)
        cost += _REPLY_PRIMING
        for key in ("tools", "functions"):
            if body.get(key):
                cost += _text_cost(_json(body[key]))
        response_format = body.get("response_format")
        if isinstance(response_format, Mapping) and "json_schema" in response_format:
            cost += _text_cost(_json(response_format["json_schema"]))
    else:
        for prompt in _prompts(body.get("prompt")):
            if isinstance(prompt, str):
                cost += _text_cost(prompt)
            else:
                cost += len(prompt)
        suffix = body.get("suffix")
        if isinstance(suffix, str):
            cost += _text_cost(suffix)
    return math.ceil(cost)


def completion_cap(api: Api, body: Mapping[str, Any], default_max_tokens: int) -> int:
    """The most completion tokens the request can produce, over all its choices.

    Per choice: ``max_completion_tokens`` / ``max_tokens`` (the smaller when
    both are given) or ``default_max_tokens``. Choices: ``n`` (``best_of`` for
    completions, which generates that many), times the number of prompts of a
    batched completions request.
    """
    if api == Api.EMBEDDINGS:
        return 0  # an embedding's cost is its input
    if api == Api.RESPONSES:
        cap = _int(body.get("max_output_tokens"))
        return max(0, cap) if cap is not None else default_max_tokens
    names = ("max_completion_tokens", "max_tokens") if api == Api.CHAT else ("max_tokens",)
    given = [v for name in names if (v := _int(body.get(name))) is not None]
    per_choice = max(0, min(given)) if given else default_max_tokens
    choices = _count(body.get("n"))
    if api == Api.COMPLETIONS:
        choices = max(choices, _count(body.get("best_of")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
            choices *= len(prompt)
    return per_choice * choices


def reservation(api: Api, body: Mapping[str, Any], default_max_tokens: int) -> int:
    """Tokens to reserve before the request runs: prompt estimate + completion cap."""
    return estimate_prompt_tokens(api, body) + completion_cap(api, body, default_max_tokens)


def _responses_cost(body: Mapping[str, Any]) -> float:
    """A Responses body: ``instructions``, ``input`` (a text or a list of
    items: messages, function calls and their outputs), the tool definitions."""
    cost = float(_REPLY_PRIMING)
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        cost += _PER_MESSAGE + _text_cost(instructions)
    items = body.get("input")
    if isinstance(items, str):
        cost += _PER_MESSAGE + _text_cost(items)
    for item in items if isinstance(items, list) else ():
        if not isinstance(item, Mapping):
            continue
        if "content" in item or "role" in item:
            cost += _message_cost(item)
            continue
        cost += _PER_TOOL_CALL
        for key in ("name", "arguments", "output"):
            value = item.get(key)
            if isinstance(value, str):
                cost += _text_cost(value)
    if body.get("tools"):
        cost += _text_cost(_json(body["tools"]))
    return cost


def _messages_cost(body: Mapping[str, Any]) -> float:
    """An Anthropic Messages body: ``system``, each turn's content blocks
    (text, images, tool calls and their results), the tool definitions."""
    cost = float(_REPLY_PRIMING)
    system = body.get("system")
    blocks: list[Any] = [{"type": "text", "text": system}] if isinstance(system, str) else (
        list(system) if isinstance(system, list) else [])
    if blocks:
        cost += _PER_MESSAGE
    turns = body.get("messages")
    for turn in turns if isinstance(turns, list) else ():
        if not isinstance(turn, Mapping):
            continue
        cost += _PER_MESSAGE
        content = turn.get("content")
        if isinstance(content, str):
            cost += _text_cost(content)
        elif isinstance(content, list):
            blocks.extend(content)
    while blocks:
        block = blocks.pop()
        if not isinstance(block, Mapping):
            continue
        kind = block.get("type")
        if isinstance(block.get("text"), str):
            cost += _text_cost(block["text"])
        elif kind == "image":
            cost += _IMAGE_TOKENS
        elif kind == "tool_use":
            cost += _PER_TOOL_CALL + _text_cost(_json(block.get("input")))
            if isinstance(block.get("name"), str):
                cost += _text_cost(block["name"])
        elif kind == "tool_result":
            content = block.get("content")
            if isinstance(content, str):
                cost += _PER_TOOL_CALL + _text_cost(content)
            elif isinstance(content, list):
                cost += _PER_TOOL_CALL
                blocks.extend(content)
    if body.get("tools"):
        cost += _text_cost(_json(body["tools"]))
    return cost


def _message_cost(message: Mapping[str, Any]) -> float:
    cost = float(_PER_MESSAGE)
    content = message.get("content")
    if isinstance(content, str):
        cost += _text_cost(content)
    elif isinstance(content, list):
        for part in content:
            if not isinstance(part, Mapping):
                continue
            if isinstance(part.get("text"), str):
                cost += _text_cost(part["text"])
            elif part.get("type") in ("image_url", "input_image"):
                cost += _IMAGE_TOKENS
    name = message.get("name")
    if isinstance(name, str):
        cost += _PER_NAME + _text_cost(name)
    tool_calls = message.get("tool_calls")
    for call in tool_calls if isinstance(tool_calls, list) else ():
        function = call.get("function") if isinstance(call, Mapping) else None
        if isinstance(function, Mapping):
            cost += _PER_TOOL_CALL
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    cost += _text_cost(function[key])
    return cost


def _prompts(prompt: Any) -> Iterable[str | list[Any]]:
    """Completions' ``prompt`` as a sequence of texts and token arrays."""
    if isinstance(prompt, str):
        return (prompt,)
    if not isinstance(prompt, list) or not prompt:
        return ()
    if _is_int(prompt[0]):
        return (prompt,)  # one prompt as token ids
    return [p for p in prompt if isinstance(p, str | list)]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_int(value: Any) -> bool:
    return _int(value) is not None


def _count(value: Any) -> int:
    number = _int(value)
    return number if number is not None and number >= 1 else 1


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str)
