"""The prefix-cache model behind the simulator's and fake backend's TTFT."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from workers.backends.prefix_cache import PrefixCache


def test_a_repeated_prefix_hits_whole_blocks() -> None:
    cache = PrefixCache(block_chars=4)
    assert cache.lookup("abcdefghij") == (0, 10)
    # Turn 2 repeats turn 1 and adds more: the two whole blocks of turn 1 hit.
    assert cache.lookup("abcdefghij and more") == (8, 19)
    assert cache.hits == 1


def test_a_different_block_breaks_the_chain() -> None:
    cache = PrefixCache(block_chars=4)
    cache.lookup("aaaabbbbcccc")
    # Same third block, different second one: the chain stops at the first.
    assert cache.lookup("aaaaXXXXcccc") == (4, 12)
    assert cache.lookup("Zaaabbbbcccc") == (0, 12)


def test_bounded_lru() -> None:
    cache = PrefixCache(block_chars=1, capacity_blocks=3)
    cache.lookup("abc")
    cache.lookup("x")  # evicts the oldest block ("a")
    assert len(cache) == 3
    assert cache.lookup("abc")[0] == 0  # the chain's first block is gone


def test_bad_sizes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefixCache(block_chars=0)


@given(st.text(max_size=200), st.text(max_size=200))
def test_property_cached_never_exceeds_the_common_prefix(a: str, b: str) -> None:
    cache = PrefixCache(block_chars=8)
    cache.lookup(a)
    cached, total = cache.lookup(b)
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    assert cached <= common
    assert cached % 8 == 0
    assert total == len(b)
    assert len(cache) <= cache.capacity
