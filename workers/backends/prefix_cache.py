"""A model of a backend's prefix (KV) cache, for the simulator and the fake
backend, so the effect of cache-aware routing shows without a GPU.

vLLM and SGLang cache the KV of a prompt in fixed-size blocks keyed by a hash
that chains every block before it, so a block hits only when the whole prefix
up to it matches. Prefill then runs only on the blocks after the last hit.
This class keeps the same shape in a bounded LRU of block hashes (one per
process, like one replica's GPU memory): :meth:`lookup` says how much of a
prompt was cached and remembers the prompt, and the caller turns the uncached
part into prefill time.

Sans-I/O and deterministic: no clock, no randomness.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any


class PrefixCache:
    def __init__(self, *, block_chars: int = 256, capacity_blocks: int = 4096) -> None:
        if block_chars < 1 or capacity_blocks < 1:
            raise ValueError("block_chars and capacity_blocks must be >= 1")
        self.block_chars = block_chars
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self.hits = 0  # prompts whose first block was cached
        self.lookups = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, prompt: str) -> tuple[int, int]:
        """(cached chars, total chars) of ``prompt``; the prompt's blocks are
        cached afterwards, the least recently used evicted past capacity.

        Only whole blocks are cached, as on a GPU: the tail shorter than a
        block is always prefilled."""
        self.lookups += 1
        cached = 0
        chain = hashlib.blake2b(digest_size=16)
        matching = True
        whole = len(prompt) - len(prompt) % self.block_chars
        for start in range(0, whole, self.block_chars):
            chain.update(prompt[start:start + self.block_chars].encode("utf-8", "surrogatepass"))
            key = chain.copy().digest()
            if matching and key in self._blocks:
                cached += self.block_chars
                self._blocks.move_to_end(key)
                continue
            matching = False
            self._blocks[key] = None
            if len(self._blocks) > self.capacity:
                self._blocks.popitem(last=False)
        if cached:
            self.hits += 1
        return cached, len(prompt)


def prompt_text(body: Mapping[str, Any], chat: bool) -> str:
    """A request's prompt as the text a server would tokenize (roles marked),
    what the cache model hashes."""
    if not chat:
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    parts = []
    for message in body.get("messages") or ():
        if isinstance(message, Mapping):
            content = message.get("content")
            parts.append(f"<{message.get('role')}>"
                         + (content if isinstance(content, str) else json.dumps(content)))
    return "".join(parts)
