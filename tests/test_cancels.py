"""Recently cancelled request ids (tidegate.cancels), with a fake clock; the
tombstone bucket's replay (tidegate.broker.watch_cancels) on a real nats-server."""

from __future__ import annotations

import asyncio

import nats
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.pipeline import wait_for
from tests.servers import ServerHandle
from tidegate import config as tgconfig
from tidegate.broker import broker, kvwatch
from tidegate.wire.cancels import CancelRegistry


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(ttl: float = 10.0, max_entries: int = 100) -> tuple[CancelRegistry, FakeClock]:
    clock = FakeClock()
    return CancelRegistry(ttl=ttl, max_entries=max_entries, clock=clock), clock


def test_empty_registry() -> None:
    registry, _ = make()
    assert len(registry) == 0
    assert "r1" not in registry


def test_added_id_is_member() -> None:
    registry, _ = make()
    registry.add("r1")
    assert "r1" in registry
    assert "r2" not in registry
    assert len(registry) == 1


def test_non_string_membership_is_false() -> None:
    registry, _ = make()
    registry.add("1")
    assert 1 not in registry
    assert None not in registry


def test_add_twice_keeps_one_entry() -> None:
    registry, _ = make()
    registry.add("r1")
    registry.add("r1")
    assert len(registry) == 1


def test_entry_expires_after_ttl() -> None:
    registry, clock = make(ttl=10.0)
    registry.add("r1")
    clock.now = 1009.5
    assert "r1" in registry
    clock.now = 1010.0  # exactly ttl: expired (expiry must be strictly in the future)
    assert "r1" not in registry
    clock.advance(100)
    assert "r1" not in registry


def test_expired_entries_are_purged_on_add() -> None:
    registry, clock = make(ttl=10.0)
    registry.add("a")
    registry.add("b")
    clock.advance(5)
    registry.add("c")
    clock.advance(6)  # a and b expired, c not
    registry.add("d")
    assert len(registry) == 2
    assert "a" not in registry
    assert "b" not in registry
    assert "c" in registry
    assert "d" in registry


def test_re_adding_refreshes_expiry() -> None:
    registry, clock = make(ttl=10.0)
    registry.add("r1")
    clock.advance(8)
    registry.add("r1")
    clock.advance(8)  # 16 s after the first add, 8 after the second
    assert "r1" in registry
    clock.advance(2)
    assert "r1" not in registry


def test_re_added_entry_is_not_purged_as_oldest() -> None:
    registry, clock = make(ttl=10.0)
    registry.add("a")
    clock.advance(1)
    registry.add("b")
    clock.advance(8)
    registry.add("a")  # a now expires at 19, b at 11
    clock.advance(3)  # t = 12
    registry.add("c")
    assert "b" not in registry
    assert "a" in registry
    assert "c" in registry
    assert len(registry) == 2


def test_zero_ttl_never_holds_anything() -> None:
    registry, _ = make(ttl=0.0)
    registry.add("r1")
    assert "r1" not in registry
    assert len(registry) == 0


def test_max_entries_evicts_oldest() -> None:
    registry, _ = make(max_entries=3)
    for rid in ("a", "b", "c"):
        registry.add(rid)
    assert len(registry) == 3
    registry.add("d")
    assert len(registry) == 3
    assert "a" not in registry
    assert all(rid in registry for rid in ("b", "c", "d"))
    registry.add("e")
    assert "b" not in registry
    assert all(rid in registry for rid in ("c", "d", "e"))


def test_eviction_order_follows_last_add() -> None:
    registry, _ = make(max_entries=2)
    registry.add("a")
    registry.add("b")
    registry.add("a")  # a becomes the newest
    registry.add("c")
    assert "b" not in registry
    assert "a" in registry
    assert "c" in registry


def test_max_entries_one() -> None:
    registry, _ = make(max_entries=1)
    registry.add("a")
    registry.add("b")
    assert len(registry) == 1
    assert "a" not in registry
    assert "b" in registry


def test_default_clock_and_limits() -> None:
    registry = CancelRegistry()
    registry.add("r1")
    assert "r1" in registry


@settings(max_examples=100)
@given(
    ttl=st.floats(min_value=0.5, max_value=50),
    max_entries=st.integers(1, 8),
    ops=st.lists(
        st.tuples(st.sampled_from("abcdefghij"), st.floats(min_value=0, max_value=20)),
        max_size=60,
    ),
)
def test_matches_reference_model(ttl: float, max_entries: int,
                                 ops: list[tuple[str, float]]) -> None:
    """Membership equals: added within ttl, and among the max_entries most
    recently added ids. Size never exceeds max_entries."""
    registry, clock = make(ttl=ttl, max_entries=max_entries)
    added: dict[str, float] = {}  # id -> time of its last add
    for rid, wait in ops:
        clock.advance(wait)
        registry.add(rid)
        added.pop(rid, None)
        added[rid] = clock.now
        assert len(registry) <= max_entries
        recent = list(added)[-max_entries:]
        for candidate in "abcdefghij":
            expected = candidate in recent and added[candidate] + ttl > clock.now
            assert (candidate in registry) == expected, candidate


# --------------------------------------------------------------------------
# The tombstone bucket on a real nats-server
# --------------------------------------------------------------------------


async def test_follow_cancels_returns_after_existing_tombstones(
        nats_server: ServerHandle) -> None:
    """A worker or dispatcher waits for this before it pulls: every tombstone
    written before it started must be known by then, or a request cancelled
    while nobody was pulling would run anyway."""
    config = tgconfig.from_dict({"nats": {"url": nats_server.url}})
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        kv = await broker.ensure_cancels_bucket(js, config)
        ids = [f"req-{i}" for i in range(50)]
        for request_id in ids:
            await kv.put(request_id, b"client_disconnected")
        registry = CancelRegistry(ttl=60.0)
        async with asyncio.TaskGroup() as tg:
            started = asyncio.get_running_loop().time()
            watcher = await broker.follow_cancels(
                tg, kv, lambda request_id, reason: registry.add(request_id), 120.0, "test")
            # Returned on the replay, not on the limit (two minutes: only the
            # limit is a bound here, not how fast this machine replays).
            assert asyncio.get_running_loop().time() - started < 120.0
            assert all(request_id in registry for request_id in ids)
            await kv.put("req-late", b"client_disconnected")  # live ones follow
            assert await wait_for(lambda: "req-late" in registry, 5.0)
            watcher.cancel()
    finally:
        await nc.close()


async def test_wait_synced_gives_up_after_its_limit() -> None:
    """A bucket that never replays (broker trouble) delays pulling by the
    limit, not forever."""
    started = asyncio.get_running_loop().time()
    assert not await kvwatch.wait_synced(asyncio.Event(), 0.2, "test")
    # At its limit, not before (it returning at all is the "not forever";
    # how late a busy machine wakes it is not the promise).
    assert asyncio.get_running_loop().time() - started >= 0.19
    synced = asyncio.Event()
    synced.set()
    assert await kvwatch.wait_synced(synced, 0.2, "test")
