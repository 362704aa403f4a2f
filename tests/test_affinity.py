"""Session affinity, sans-I/O (tidegate.wire.affinity): the key and the route."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tidegate.wire.affinity import (
    PREFIX_BYTES,
    Reason,
    ReplicaLoad,
    Route,
    affinity_key,
    choose,
    prompt_chars,
    reusable_chars,
)


def chat(*messages: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in messages],
            **extra}


def turns(system: str, users: list[str]) -> list[dict[str, Any]]:
    """The bodies of one conversation's turns, each repeating the ones before."""
    out, history = [], [("system", system)]
    for i, text in enumerate(users):
        history.append(("user", text))
        out.append(chat(*history))
        history.append(("assistant", f"answer {i}"))
    return out


# -- the key -----------------------------------------------------------------


def test_stable_across_the_turns_of_one_chat() -> None:
    keys = {affinity_key("messages", body) for body in turns("be brief", ["hi", "more", "why"])}
    assert len(keys) == 1
    assert None not in keys


def test_different_across_chats() -> None:
    a = affinity_key("messages", chat(("system", "be brief"), ("user", "plan a trip")))
    b = affinity_key("messages", chat(("system", "be brief"), ("user", "write a poem")))
    c = affinity_key("messages", chat(("system", "be verbose"), ("user", "plan a trip")))
    assert len({a, b, c}) == 3


def test_prompt_cache_key_overrides_the_prefix() -> None:
    one = chat(("user", "hello"), prompt_cache_key="conv-1")
    other = chat(("user", "something else entirely"), prompt_cache_key="conv-1")
    plain = chat(("user", "hello"))
    assert affinity_key("messages", one) == affinity_key("messages", other)
    assert affinity_key("messages", one) != affinity_key("messages", plain)
    # A key of "" is no key: the prefix decides.
    assert affinity_key("messages", chat(("user", "hello"), prompt_cache_key="")) == \
        affinity_key("messages", plain)


def test_user_is_mixed_in_only_when_asked() -> None:
    alice = chat(("user", "hello"), user="alice")
    bob = chat(("user", "hello"), user="bob")
    assert affinity_key("messages", alice) == affinity_key("messages", bob)
    assert affinity_key("messages", alice, user=True) != affinity_key("messages", bob, user=True)


def test_content_parts_and_roles() -> None:
    parts = chat(("user", [{"type": "text", "text": "hello"}, {"type": "image_url"}]))
    assert affinity_key("messages", parts) == affinity_key("messages", chat(("user", "hello")))
    # The role is part of the prefix: the same text as system or user differs.
    assert affinity_key("messages", chat(("system", "x"))) != \
        affinity_key("messages", chat(("user", "x")))


def test_no_text_no_key() -> None:
    assert affinity_key("messages", {"messages": []}) is None
    assert affinity_key("messages", {"messages": "nope"}) is None
    assert affinity_key("messages", chat(("assistant", "I start"))) is None
    assert affinity_key("messages", chat(("user", ""))) is None
    assert affinity_key("prompt", {"prompt": ""}) is None
    assert affinity_key("prompt", {}) is None


def test_completions_prompts() -> None:
    long = "x" * 100 + "tail"
    assert affinity_key("prompt", {"prompt": long}) is not None
    assert affinity_key("prompt", {"prompt": [long, "b"]}) == \
        affinity_key("prompt", {"prompt": long})
    assert affinity_key("prompt", {"prompt": [1, 2, 3]}) == \
        affinity_key("prompt", {"prompt": [[1, 2, 3]]})


def test_only_the_bounded_prefix_counts() -> None:
    head = "s" * PREFIX_BYTES
    a = affinity_key("messages", chat(("system", head + "one"), ("user", "q")))
    b = affinity_key("messages", chat(("system", head + "two"), ("user", "other")))
    assert a == b  # everything past the bound is not hashed


def test_bounded_work_for_a_huge_prompt() -> None:
    huge = chat(("system", "y" * 50_000_000), *[("user", "z" * 1000)] * 1000)
    small = chat(("system", "y" * 5_000), ("user", "z" * 1000))

    def cost(body: dict[str, Any]) -> float:
        # The least of a few runs: what the work costs, not what a busy
        # machine's scheduler added to one of them.
        runs = []
        for _ in range(7):
            started = time.perf_counter()
            affinity_key("messages", body)
            runs.append(time.perf_counter() - started)
        return min(runs)

    # A prompt 10,000 times longer costs about the same: only its first
    # PREFIX_BYTES are hashed. A whole-prompt encode of the 50 MB would cost
    # thousands of times the small one's; the bound is a ratio measured in
    # this run, so a slow machine slows both sides alike.
    assert cost(huge) < 20 * cost(small) + 0.0005


def test_hostile_shapes_give_a_key_or_none_never_raise() -> None:
    for body in ({"messages": [None, 1, "x"]}, {"messages": [{"role": ["x"]}]},
                 {"messages": [{"role": "user", "content": {"a": 1}}]},
                 {"prompt": [None]}, {"prompt": [True]}, {"prompt_cache_key": 7},
                 {"messages": [{"role": "user", "content": "\ud800"}]}):
        affinity_key("messages", body)
        affinity_key("prompt", body)


text = st.text(max_size=40)


@given(system=text, users=st.lists(text.filter(bool), min_size=1, max_size=6))
def test_property_every_turn_shares_the_first_turns_key(system: str, users: list[str]) -> None:
    keys = {affinity_key("messages", body) for body in turns(system, users)}
    assert len(keys) == 1


@given(a=text.filter(bool), b=text.filter(bool))
def test_property_different_first_messages_differ(a: str, b: str) -> None:
    if a != b:
        assert affinity_key("messages", chat(("user", a))) != \
            affinity_key("messages", chat(("user", b)))


# -- the route ---------------------------------------------------------------


def load(name: str, in_flight: int = 0, limit: int = 8, **kw: Any) -> ReplicaLoad:
    return ReplicaLoad(name, in_flight, limit, **kw)


def test_single_replica_or_no_key_uses_the_shared_queue() -> None:
    assert choose("k", None, [load("a")]) == Route(None, Reason.OFF)
    assert choose(None, "a", [load("a"), load("b")]) == Route(None, Reason.NO_KEY)


def test_home_with_room_wins() -> None:
    assert choose("k", "b", [load("a"), load("b", 7)]) == Route("b", Reason.HOME)


def test_busy_home_falls_back_to_the_shared_queue() -> None:
    assert choose("k", "b", [load("a"), load("b", 8)]) == Route(None, Reason.HOME_BUSY)
    # A replica whose backend reports waiting requests is busy too.
    assert choose("k", "b", [load("a"), load("b", 1, waiting=3)]) == \
        Route(None, Reason.HOME_BUSY)


# A full home whose slots free one every 10 ms (80 ms a job over 8 slots),
# on a backend that prefills 100 us a character away from its cache.
TIMED = {"service_s": 0.08, "prefill_s_per_char": 100e-6}


def test_a_full_home_is_waited_for_when_its_slot_comes_before_the_prefill_saved() -> None:
    loads = [load("a"), load("b", 8, **TIMED)]
    # 2,000 cached characters: 200 ms of prefill saved against a 10 ms wait.
    assert choose("k", "b", loads, reusable=2000, max_wait=0.5) == Route("b", Reason.HOME_WAIT)
    # 50 characters save 5 ms: not worth 10 ms.
    assert choose("k", "b", loads, reusable=50, max_wait=0.5) == Route(None, Reason.HOME_BUSY)
    # A first turn saves nothing.
    assert choose("k", "b", loads, reusable=0, max_wait=0.5) == Route(None, Reason.HOME_BUSY)


def test_the_jobs_ahead_at_a_full_home_lengthen_its_wait() -> None:
    # 8 routed past its limit and 12 waiting in the backend: 21 slots' turns
    # ahead, 210 ms, more than the 200 ms saved.
    loads = [load("a"), load("b", 16, waiting=12, **TIMED)]
    assert choose("k", "b", loads, reusable=2000, max_wait=0.5) == Route(None, Reason.HOME_BUSY)
    loads = [load("a"), load("b", 16, waiting=10, **TIMED)]
    assert choose("k", "b", loads, reusable=2000, max_wait=0.5) == Route("b", Reason.HOME_WAIT)


def test_a_full_home_is_not_waited_for_past_the_fallback_or_without_its_times() -> None:
    loads = [load("a"), load("b", 8, **TIMED)]
    # Past routing.max_affinity_wait, the job would be copied anyway.
    assert choose("k", "b", loads, reusable=100_000, max_wait=0.005) == \
        Route(None, Reason.HOME_BUSY)
    # Times not measured yet (a new worker): the shared queue, as before.
    for missing in ({"service_s": 0.08}, {"prefill_s_per_char": 1e-4}, {}):
        loads = [load("a"), load("b", 8, **missing)]
        assert choose("k", "b", loads, reusable=100_000, max_wait=0.5) == \
            Route(None, Reason.HOME_BUSY)


def test_reusable_chars_are_the_turns_before_the_last_user_message() -> None:
    body = chat(("system", "s" * 10), ("user", "u" * 20), ("assistant", "a" * 30),
                ("user", "v" * 40))
    assert reusable_chars(body) == 60
    assert prompt_chars(body) == 100
    assert reusable_chars(chat(("user", "hello"))) == 0
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abc"},
                                                      {"type": "image_url"}]},
                          {"role": "assistant", "content": "de"},
                          {"role": "user", "content": "f"}]}
    assert reusable_chars(parts) == 5
    # Anthropic's system field precedes every message.
    assert reusable_chars({"system": "x" * 7, "messages": [{"role": "user", "content": "y"}]}) \
        == 7
    # A prompt has no turns; its length still counts as prompt.
    assert reusable_chars({"prompt": "p" * 9}) == 0
    assert prompt_chars({"prompt": ["ab", "c", 3]}) == 3
    # Hostile shapes count what is text and never raise.
    for body in ({"messages": "x"}, {"messages": [None, 3, {"role": "user"}]},
                 {"messages": [{"role": "user", "content": [None, {"text": 5}]}]}):
        assert reusable_chars(body) == 0


def test_gone_home_is_chosen_anew() -> None:
    route = choose("k", "dead", [load("a"), load("b")])
    assert route.reason is Reason.HOME_GONE
    assert route.replica in {"a", "b"}


def test_all_busy_uses_the_shared_queue() -> None:
    assert choose("k", None, [load("a", 8), load("b", 9)]) == Route(None, Reason.ALL_BUSY)


def test_new_keys_spread_evenly_over_equal_replicas() -> None:
    replicas = [load(f"r{i}") for i in range(4)]
    counts = Counter(choose(f"key-{i}", None, replicas).replica for i in range(4000))
    assert set(counts) == {"r0", "r1", "r2", "r3"}
    # 1000 expected each; binomial sd ~27, so 1.3x the mean is far outside chance.
    assert max(counts.values()) < 1.3 * 1000


def test_new_keys_prefer_headroom() -> None:
    replicas = [load("idle", 0), load("busy", 6), load("kvfull", 0, kv_usage=0.9)]
    counts = Counter(choose(f"key-{i}", None, replicas).replica for i in range(3000))
    assert counts["idle"] > counts["busy"] > 0
    assert counts["idle"] > counts["kvfull"] > 0


def test_a_new_key_goes_to_the_same_replica_on_every_dispatcher() -> None:
    replicas = [load("a", 1), load("b", 2), load("c", 0)]
    assert len({choose("conv", None, list(order)).replica
                for order in (replicas, replicas[::-1], replicas[1:] + replicas[:1])}) == 1


def test_removing_a_replica_moves_only_its_keys() -> None:
    four = [load(f"r{i}") for i in range(4)]
    before = {k: choose(k, None, four).replica for k in (f"key-{i}" for i in range(1000))}
    three = four[:3]
    after = {k: choose(k, None, three).replica for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert all(before[k] == "r3" for k in moved)


@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=2, max_size=6),
       st.text(min_size=1, max_size=10), st.one_of(st.none(), st.integers(0, 7)))
def test_property_route_goes_only_to_a_replica_with_room(
        loads: list[tuple[int, int]], key: str, home_index: int | None) -> None:
    replicas = [load(f"r{i}", busy, limit) for i, (busy, limit) in enumerate(loads)]
    home = None if home_index is None else f"r{home_index}"
    route = choose(key, home, replicas)
    if route.replica is not None:
        chosen = next(r for r in replicas if r.name == route.replica)
        assert chosen.free > 0
    else:
        assert route.reason in {Reason.HOME_BUSY, Reason.ALL_BUSY}
        if route.reason is Reason.ALL_BUSY:
            assert all(r.free <= 0 for r in replicas)


def test_the_first_user_message_ends_the_prefix() -> None:
    # A turn that adds a user message without an answer in between (a client
    # that sends two in a row) still reaches the replica holding the first.
    assert affinity_key("messages", chat(("user", "a"), ("user", "b"))) == \
        affinity_key("messages", chat(("user", "a")))
