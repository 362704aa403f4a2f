"""Deterministic text as a greedy model writes it: token ``i`` of an answer is
a function of (prompt, i) only, and a trailing assistant message is continued
from where it ends.

The simulator (``simulator.deterministic``) and the bench's fake backend answer
with it, so a stream continued after a failure can be checked byte-exact
against an uninterrupted run. The base prompt (without a trailing assistant
message) seeds the answer; piece ``i`` is one word of :data:`WORDS`; a trailing
assistant message that is the answer's start is continued (from inside a cut
piece if need be), any other is ignored. Without a token limit the answer is
``length`` pieces including the prefix's; with one, the limit counts new
pieces. Docs: docs/resume.md#continuation.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, overload

WORDS = (
    "tide", "gate", "stream", "token", "river", "harbor", "signal", "window", "beacon",
    "anchor", "current", "vessel", "channel", "quiet", "steady", "bright", "amber",
    "silver", "ocean", "delta", "north", "lantern", "meadow", "cedar", "echo", "pulse",
    "orbit", "prism", "ember", "willow", "granite", "drift",
)
_SPACED = tuple(" " + w for w in WORDS)
_MASK = (1 << 64) - 1


def base_and_prefix(chat: bool, body: Mapping[str, Any]) -> tuple[Any, str]:
    """The prompt that seeds the answer, and the assistant prefix to continue."""
    if not chat:
        return body.get("prompt"), ""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        last = messages[-1]
        if (isinstance(last, Mapping) and last.get("role") == "assistant"
                and isinstance(last.get("content"), str)):
            return messages[:-1], str(last["content"])
    return messages, ""


def seed_of(prompt: Any) -> int:
    raw = json.dumps(prompt, sort_keys=True, default=str).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big")


def piece(seed: int, i: int) -> str:
    """Piece ``i`` of the answer seeded by ``seed`` (splitmix64 of seed + i)."""
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    k = (z ^ (z >> 31)) % len(WORDS)
    return WORDS[k] if i == 0 else _SPACED[k]


class GreedyPlan(Sequence[str]):
    """The pieces still to write, lazily: ``head`` (the rest of a piece the
    prefix cut, if any), then pieces ``start``, ``start + 1``, ..."""

    __slots__ = ("_count", "_head", "_seed", "_start", "finish", "resumed")

    def __init__(self, seed: int, prefix: str, limit: int | None, length: int) -> None:
        self._seed = seed
        text, i = "", 0
        while len(text) < len(prefix):
            text += piece(seed, i)
            i += 1
        if prefix and text.startswith(prefix):
            self._head = text[len(prefix):]
            self._start = i
            used = i - (1 if self._head else 0)
        else:
            self._head, self._start, used = "", 0, 0
        self.resumed = used  # whole pieces of the answer the prefix held
        if limit is None:
            self._count = max(0, length - used)  # the cut piece's rest is one of them
            self.finish = "stop"
        else:
            self._count = max(0, limit)
            self.finish = "length"

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
        if self._head:
            return self._head if index == 0 else piece(self._seed, self._start + index - 1)
        return piece(self._seed, self._start + index)

    def __iter__(self) -> Iterator[str]:
        for i in range(self._count):
            yield self[i]


def greedy_plan(chat: bool, body: Mapping[str, Any], limit: int | None,
                length: int) -> GreedyPlan:
    prompt, prefix = base_and_prefix(chat, body)
    return GreedyPlan(seed_of(prompt), prefix, limit, length)
