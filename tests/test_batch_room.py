"""The batch share rule (dispatcher/batch/room.py), on numbers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dispatcher.batch.room import batch_room, others_wait


def room(slots: int, running: int, started: int = 0, unstarted: int = 0,
         share: float = 0.1, waiting: bool = False) -> int:
    return batch_room(slots=slots, running=running, batch_running=started,
                      batch_unstarted=unstarted, share=share, waiting=waiting)


def test_a_waiting_job_or_queue_mode_stops_batch() -> None:
    assert room(100, 0, waiting=True) == 0


def test_the_runners_own_unpulled_lines_are_not_a_waiting_job() -> None:
    assert not others_wait(pending=0, unstarted=0)
    assert not others_wait(pending=3, unstarted=3), "three of its lines, not yet pulled"
    assert not others_wait(pending=2, unstarted=3), "one of them pulled already"
    assert others_wait(pending=4, unstarted=3), "a fourth job is somebody else's"
    assert others_wait(pending=1, unstarted=0)


def test_with_no_interactive_job_batch_takes_every_free_slot() -> None:
    assert room(100, 0) == 100
    # 30 running, all of them batch lines: still no interactive job.
    assert room(100, 30, started=30) == 70
    # Released lines no worker has started yet take their slots already.
    assert room(100, 30, started=20, unstarted=10) == 60


def test_interactive_load_leaves_batch_a_share_of_what_it_leaves_free() -> None:
    # 50 interactive jobs on 256 slots: batch may hold ceil(0.1 * 206) = 21.
    assert room(256, 50) == 21
    assert room(256, 60, started=10) == 11
    assert room(256, 71, started=21) == 0
    # More interactive load, a smaller share.
    assert room(256, 200) == 6


def test_the_share_rounds_up_so_a_batch_never_starves_while_a_slot_is_free() -> None:
    assert room(2, 1) == 1
    assert room(2, 2, started=1) == 0  # no free slot


def test_a_share_of_one_is_the_free_slot_rule() -> None:
    assert room(100, 40, started=10, share=1.0) == 60


@given(slots=st.integers(0, 500), running=st.integers(0, 500),
       started=st.integers(0, 500), unstarted=st.integers(0, 500),
       share=st.floats(0.01, 1.0), waiting=st.booleans())
def test_never_more_than_free_never_negative(slots: int, running: int, started: int,
                                             unstarted: int, share: float,
                                             waiting: bool) -> None:
    started = min(started, running)
    got = room(slots, running, started, unstarted, share, waiting)
    assert 0 <= got <= max(0, slots - running - unstarted)
    if waiting:
        assert got == 0
    # Every released line counts as batch (an unstarted one may be in running).
    interactive = running - started - unstarted
    if interactive > 0:
        # Batch's holding after the release stays within the share (rounded up).
        assert got == 0 or started + unstarted + got <= -(-share * (slots - interactive) // 1)


@given(slots=st.integers(1, 500), started=st.integers(0, 100), share=st.floats(0.01, 1.0))
def test_more_interactive_load_never_grows_the_room(slots: int, started: int,
                                                    share: float) -> None:
    rooms = [room(slots, i + started, started, 0, share) for i in range(1, slots + 1)]
    assert rooms == sorted(rooms, reverse=True)
