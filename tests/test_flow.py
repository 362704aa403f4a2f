"""Credit-window flow control (tidegate.flow): SendWindow, AckPolicy, and the
worker/edge loop they form, simulated in pure Python."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tidegate.wire.flow import AckPolicy, SendWindow

# --------------------------------------------------------------------------
# SendWindow: examples
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("max_bytes", "max_msgs"), [(0, 1), (1, 0), (-1, 5), (5, -1), (0, 0)])
def test_window_sizes_must_be_positive(max_bytes: int, max_msgs: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        SendWindow(max_bytes, max_msgs)


def test_new_window_is_open_and_empty() -> None:
    w = SendWindow(100, 4)
    assert w.open
    assert w.available_bytes == 100
    assert w.in_flight_bytes == 0
    assert w.in_flight_msgs == 0
    assert w.sent_seq == 0
    assert w.acked_seq == 0
    assert w.max_bytes == 100
    assert w.max_msgs == 4


def test_minimal_window_closes_after_one_message() -> None:
    w = SendWindow(1, 1)
    w.on_send(1, 0)
    assert not w.open
    assert w.on_ack(1)
    assert w.open


def test_closes_when_bytes_reach_max() -> None:
    w = SendWindow(100, 10)
    w.on_send(1, 60)
    assert w.open
    assert w.available_bytes == 40
    w.on_send(2, 39)
    assert w.open
    assert w.available_bytes == 1
    w.on_send(3, 1)
    assert not w.open
    assert w.available_bytes == 0
    assert w.in_flight_bytes == 100
    assert w.in_flight_msgs == 3


def test_one_message_may_overshoot_and_available_bytes_clamps_to_zero() -> None:
    w = SendWindow(100, 10)
    w.on_send(1, 99)
    assert w.open
    w.on_send(2, 500)
    assert not w.open
    assert w.in_flight_bytes == 599
    assert w.available_bytes == 0


def test_closes_when_messages_reach_max() -> None:
    w = SendWindow(1_000_000, 3)
    for seq in (1, 2):
        w.on_send(seq, 10)
        assert w.open
    w.on_send(3, 10)
    assert not w.open
    assert w.in_flight_msgs == 3
    assert w.available_bytes == 1_000_000 - 30


def test_zero_byte_messages_count_against_the_message_window() -> None:
    w = SendWindow(10, 2)
    w.on_send(1, 0)
    w.on_send(2, 0)
    assert not w.open
    assert w.in_flight_bytes == 0
    assert w.available_bytes == 10


@pytest.mark.parametrize("seq", [0, -1, 5, 4])
def test_send_sequence_must_increase(seq: int) -> None:
    w = SendWindow(100, 10)
    w.on_send(5, 10)
    with pytest.raises(ValueError, match="not after"):
        w.on_send(seq, 10)
    # The rejected send left no trace.
    assert w.sent_seq == 5
    assert w.in_flight_bytes == 10
    assert w.in_flight_msgs == 1


def test_first_send_must_be_positive() -> None:
    w = SendWindow(100, 10)
    with pytest.raises(ValueError, match="not after"):
        w.on_send(0, 1)
    assert w.in_flight_msgs == 0


def test_sequences_may_have_gaps() -> None:
    # The worker's seq also numbers heartbeats, which are not in the window.
    w = SendWindow(100, 10)
    w.on_send(2, 10)
    w.on_send(5, 20)
    w.on_send(9, 30)
    assert w.on_ack(6)  # frees 2 and 5, not 9
    assert w.in_flight_bytes == 30
    assert w.in_flight_msgs == 1
    assert w.acked_seq == 6


def test_cumulative_ack_frees_prefix() -> None:
    w = SendWindow(1000, 10)
    for seq, size in [(1, 10), (2, 20), (3, 30), (4, 40)]:
        w.on_send(seq, size)
    assert w.on_ack(2)
    assert w.in_flight_bytes == 70
    assert w.in_flight_msgs == 2
    assert w.acked_seq == 2
    assert w.on_ack(4)
    assert w.in_flight_bytes == 0
    assert w.in_flight_msgs == 0
    assert w.acked_seq == 4


def test_ack_reopens_a_closed_window() -> None:
    w = SendWindow(50, 10)
    w.on_send(1, 30)
    w.on_send(2, 30)
    assert not w.open
    assert w.on_ack(1)
    assert w.open
    assert w.available_bytes == 20


@pytest.mark.parametrize("stale", [0, -3, 1, 2])
def test_stale_and_duplicate_acks_are_ignored(stale: int) -> None:
    w = SendWindow(1000, 10)
    for seq in (1, 2, 3):
        w.on_send(seq, 10)
    assert w.on_ack(2)
    assert w.on_ack(stale) is False
    assert w.acked_seq == 2
    assert w.in_flight_bytes == 10
    assert w.in_flight_msgs == 1


def test_ack_with_nothing_sent() -> None:
    w = SendWindow(100, 10)
    assert w.on_ack(5) is False
    assert w.acked_seq == 0
    assert w.in_flight_bytes == 0
    assert w.open


def test_ack_beyond_sent_is_clamped() -> None:
    w = SendWindow(100, 10)
    w.on_send(1, 10)
    w.on_send(2, 10)
    assert w.on_ack(1_000_000)
    assert w.acked_seq == 2
    assert w.in_flight_bytes == 0
    assert w.in_flight_msgs == 0
    # Later messages are not pre-acknowledged by the clamped ack.
    w.on_send(3, 10)
    assert w.in_flight_msgs == 1
    assert w.on_ack(2) is False
    assert w.in_flight_bytes == 10


def test_ack_between_messages_returns_false_when_nothing_freed() -> None:
    w = SendWindow(100, 10)
    w.on_send(5, 10)
    assert w.on_ack(3) is False  # advances acked_seq but frees nothing
    assert w.acked_seq == 3
    assert w.in_flight_bytes == 10
    assert w.on_ack(5)
    assert w.in_flight_bytes == 0


def test_kept_holds_what_a_retransmit_sends_again_until_acked() -> None:
    """kept(seq) is a retransmit's content, kept() what a worker hands on
    (workers/service.py); an acked message, in or outside the window, leaves both."""
    w = SendWindow(100, 10)
    w.hold(1, b"head")
    w.on_send(2, 1, 0.0, b"a")
    w.hold(3, b"beat")
    w.on_send(4, 1, 0.0, b"b")
    assert w.kept() == [(1, b"head"), (2, b"a"), (3, b"beat"), (4, b"b")]
    assert w.kept(3) == [(3, b"beat"), (4, b"b")]
    assert w.kept(2) == [(2, b"a"), (3, b"beat"), (4, b"b")]
    assert w.kept_bytes == 10
    w.on_ack(3)  # the held message at exactly the acked seq goes too
    assert w.kept() == [(4, b"b")]
    assert w.kept(5) == []
    assert w.kept_bytes == 1


def test_an_ack_below_the_window_still_frees_held_messages() -> None:
    w = SendWindow(100, 10)
    w.on_send(1, 1, 0.0, b"a")
    w.on_ack(1)
    w.hold(2, b"done")
    assert w.on_ack(1) is False
    assert w.kept() == [(2, b"done")]
    w.on_ack(2)
    assert w.kept() == []


def test_an_unbound_window_never_closes_and_still_counts() -> None:
    w = SendWindow(2, 1)
    assert not w.on_send(1, 5)
    w.unbound()
    assert w.open
    assert w.on_send(2, 1 << 20)
    assert w.credit > 1 << 40
    assert (w.in_flight_msgs, w.in_flight_bytes) == (2, (1 << 20) + 5)


# --------------------------------------------------------------------------
# SendWindow: stateful property test
# --------------------------------------------------------------------------


class SendWindowMachine(RuleBasedStateMachine):
    """A sender that sends only while ``open``, against a list model."""

    def __init__(self) -> None:
        super().__init__()
        self.window = SendWindow(1, 1)
        self.unacked: list[tuple[int, int]] = []
        self.largest = 0
        self.acked = 0

    @initialize(max_bytes=st.integers(1, 500), max_msgs=st.integers(1, 12))
    def setup(self, max_bytes: int, max_msgs: int) -> None:
        self.window = SendWindow(max_bytes, max_msgs)

    @precondition(lambda self: self.window.open)
    @rule(gap=st.integers(1, 3), size=st.integers(0, 1200))
    def send(self, gap: int, size: int) -> None:
        seq = self.window.sent_seq + gap
        self.window.on_send(seq, size)
        self.unacked.append((seq, size))
        self.largest = max(self.largest, size)

    @rule(delta=st.integers(-6, 8))
    def ack(self, delta: int) -> None:
        # Any ack a peer could send: stale, duplicate, in range or too high.
        seq = self.window.sent_seq + delta
        before = list(self.unacked)
        freed = self.window.on_ack(seq)
        if seq > self.acked:
            self.acked = min(seq, self.window.sent_seq)
            self.unacked = [(s, n) for s, n in self.unacked if s > self.acked]
        assert freed == (len(self.unacked) < len(before))
        assert self.window.acked_seq == self.acked

    @rule()
    def bad_send_is_rejected(self) -> None:
        with pytest.raises(ValueError, match="not after"):
            self.window.on_send(self.window.sent_seq, 1)

    @invariant()
    def accounting_matches_model(self) -> None:
        w = self.window
        assert w.in_flight_bytes == sum(n for _, n in self.unacked)
        assert w.in_flight_bytes >= 0
        assert w.in_flight_msgs == len(self.unacked)
        assert w.available_bytes == max(0, w.max_bytes - w.in_flight_bytes)
        assert w.open == (w.in_flight_bytes < w.max_bytes and w.in_flight_msgs < w.max_msgs)

    @invariant()
    def within_bounds(self) -> None:
        w = self.window
        assert w.in_flight_msgs <= w.max_msgs
        assert w.in_flight_bytes <= w.max_bytes + self.largest
        # Tighter: the last send happened below max_bytes.
        if self.unacked:
            assert w.in_flight_bytes <= w.max_bytes - 1 + self.largest


TestSendWindowMachine = SendWindowMachine.TestCase
TestSendWindowMachine.settings = settings(max_examples=150, stateful_step_count=40,
                                          deadline=None)


@given(
    max_bytes=st.integers(1, 1000),
    max_msgs=st.integers(1, 20),
    sizes=st.lists(st.integers(0, 2000), min_size=1, max_size=60),
)
def test_greedy_sender_respects_bounds(max_bytes: int, max_msgs: int, sizes: list[int]) -> None:
    """Send while open; the bound holds at the moment the window closes."""
    w = SendWindow(max_bytes, max_msgs)
    sent: list[int] = []
    for seq, size in enumerate(sizes, start=1):
        if not w.open:
            break
        w.on_send(seq, size)
        sent.append(size)
        assert w.in_flight_msgs <= max_msgs
        assert w.in_flight_bytes <= max_bytes + max(sent)
    assert w.in_flight_bytes == sum(sent)
    assert w.on_ack(len(sent))
    assert w.in_flight_bytes == 0
    assert w.in_flight_msgs == 0
    assert w.open


@given(
    max_bytes=st.integers(1, 1000),
    max_msgs=st.integers(1, 20),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 2000)), min_size=1, max_size=80),
)
def test_credit_and_on_send_agree_with_open(max_bytes: int, max_msgs: int,
                                             steps: list[tuple[bool, int]]) -> None:
    """The pushed stream's per-read shortcuts: ``credit`` is what may be sent
    now (0 while closed) and ``on_send`` returns whether the window is still
    open, the same answers as ``open`` and ``available_bytes``."""
    w = SendWindow(max_bytes, max_msgs)
    seq = 0
    for ack, size in steps:
        if ack:
            w.on_ack(max(0, seq - 1))
        elif w.open:
            seq += 1
            assert w.on_send(seq, size) is w.open
        assert w.credit == (w.available_bytes if w.open else 0)


# --------------------------------------------------------------------------
# AckPolicy: examples
# --------------------------------------------------------------------------


def test_ack_policy_initial_state() -> None:
    p = AckPolicy(400, 8)
    assert p.written_seq == 0
    assert p.acked_seq == 0
    assert p.unacked_bytes == 0
    assert p.unacked_msgs == 0


def test_ack_policy_acks_after_half_the_bytes() -> None:
    p = AckPolicy(200, 1000)  # bytes threshold 100, msgs threshold 500
    assert p.on_written(2, 60) is None
    assert p.unacked_bytes == 60
    assert p.unacked_msgs == 1
    assert p.on_written(3, 39) is None
    assert p.on_written(4, 1) == 4
    assert p.acked_seq == 4
    assert p.unacked_bytes == 0
    assert p.unacked_msgs == 0
    assert p.on_written(5, 99) is None
    assert p.on_written(6, 1) == 6


def test_ack_policy_acks_after_half_the_messages() -> None:
    p = AckPolicy(1 << 20, 4)  # msgs threshold 2
    assert p.on_written(2, 1) is None
    assert p.on_written(3, 1) == 3
    assert p.on_written(4, 1) is None
    assert p.on_written(5, 1) == 5
    assert p.acked_seq == 5


def test_ack_policy_half_an_odd_window_rounds_down() -> None:
    """An ack at most half a window after the last one, never later: the
    worker's other half is what covers the ack's round trip."""
    p = AckPolicy(1 << 20, 5)  # msgs threshold 2, not 2.5
    assert p.on_written(1, 1) is None
    assert p.on_written(2, 1) == 2
    p = AckPolicy(201, 1000)  # bytes threshold 100, not 100.5
    assert p.on_written(1, 100) == 1


def test_ack_policy_quiet_after_agrees_with_on_written_at_the_threshold() -> None:
    """The edge writes directly only what asks for no ack (edge/relay.py): a
    quiet_after that said yes to an ack-asking chunk would lose that ack."""
    for nbytes, nmsgs in [(99, 1), (100, 1), (1, 1), (1, 2)]:
        p = AckPolicy(200, 6)  # thresholds 100 bytes, 3 messages
        p.on_written(1, 0)
        assert p.quiet_after(nbytes, nmsgs) == (p.on_written(2, nbytes, nmsgs) is None), (
            nbytes, nmsgs)


def test_ack_policy_one_big_message_acks_at_once() -> None:
    p = AckPolicy(400, 1000)
    assert p.on_written(2, 10_000) == 2


@pytest.mark.parametrize(("window_bytes", "window_msgs"), [(1, 1), (3, 3), (0, 0), (2, 1000)])
def test_ack_policy_tiny_windows_ack_every_message(window_bytes: int, window_msgs: int) -> None:
    # Thresholds never drop below 1, so even a zero-byte message is acked.
    p = AckPolicy(window_bytes, window_msgs)
    for seq in range(2, 7):
        assert p.on_written(seq, 1) == seq


def test_ack_policy_zero_byte_messages_counted_by_number() -> None:
    p = AckPolicy(1000, 6)  # msgs threshold 3
    assert p.on_written(2, 0) is None
    assert p.on_written(3, 0) is None
    assert p.on_written(4, 0) == 4


def test_ack_now_acknowledges_everything_written() -> None:
    p = AckPolicy(1000, 1000)
    assert p.on_written(2, 5) is None
    assert p.on_written(3, 5) is None
    assert p.ack_now() == 3
    assert p.acked_seq == 3
    assert p.unacked_bytes == 0
    assert p.unacked_msgs == 0
    # Nothing new since: the same cumulative seq again.
    assert p.ack_now() == 3


def test_ack_now_before_anything_written() -> None:
    assert AckPolicy(100, 10).ack_now() == 0


# --------------------------------------------------------------------------
# Worker + edge, simulated
# --------------------------------------------------------------------------


class Loop:
    """One stream: a worker sending while its window is open, a FIFO wire to
    the edge, an edge that writes everything it receives, and a FIFO of acks
    back. Head is seq 1 and not in the window, as in ``workers.job``."""

    def __init__(self, sizes: list[int], window_bytes: int, window_msgs: int) -> None:
        self.sizes = sizes
        self.window = SendWindow(window_bytes, window_msgs)
        self.policy = AckPolicy(window_bytes, window_msgs)
        self.wire: deque[tuple[int, int]] = deque()
        self.acks: deque[int] = deque()
        self.next = 0
        self.seq = 1
        self.written: list[int] = []

    def can_send(self) -> bool:
        return self.window.open and self.next < len(self.sizes)

    def send(self) -> None:
        self.seq += 1
        size = self.sizes[self.next]
        self.next += 1
        self.window.on_send(self.seq, size)
        self.wire.append((self.seq, size))
        # The invariant the window exists for.
        assert self.window.in_flight_msgs <= self.window.max_msgs
        assert self.window.in_flight_bytes <= self.window.max_bytes + max(self.sizes)

    def receive(self, batch: int, per_message: bool) -> None:
        taken = [self.wire.popleft() for _ in range(min(batch, len(self.wire)))]
        self.written.extend(seq for seq, _ in taken)
        if per_message:
            for seq, size in taken:
                ack = self.policy.on_written(seq, size)
                if ack is not None:
                    self.acks.append(ack)
        else:
            # As edge.relay does: one socket write, one on_written, per batch.
            ack = self.policy.on_written(taken[-1][0], sum(size for _, size in taken),
                                         len(taken))
            if ack is not None:
                self.acks.append(ack)

    def deliver_ack(self) -> None:
        self.window.on_ack(self.acks.popleft())

    def stuck(self) -> bool:
        return not self.can_send() and not self.wire and not self.acks

    def finished(self) -> bool:
        return self.next == len(self.sizes) and not self.wire


windows = st.tuples(st.integers(1, 4096), st.integers(1, 64))
message_sizes = st.lists(st.integers(0, 3000), min_size=1, max_size=150)


@settings(max_examples=200, deadline=None)
@given(window=windows, sizes=message_sizes, data=st.data())
def test_worker_and_edge_never_deadlock(window: tuple[int, int], sizes: list[int],
                                        data: st.DataObject) -> None:
    """Any interleaving of send / receive / ack delivery ends with every message
    written: whenever the worker's window is closed, an ack is on its way."""
    loop = Loop(sizes, *window)
    for _ in range(10 * len(sizes) + 10):
        actions = []
        if loop.can_send():
            actions.append("send")
        if loop.wire:
            actions.append("receive")
        if loop.acks:
            actions.append("ack")
        if not actions:
            break
        action = data.draw(st.sampled_from(actions))
        if action == "send":
            loop.send()
        elif action == "receive":
            loop.receive(1, per_message=True)
        else:
            loop.deliver_ack()
    # Drain whatever is left deterministically, in case the step budget ran out.
    while not loop.stuck():
        if loop.acks:
            loop.deliver_ack()
        elif loop.wire:
            loop.receive(len(loop.wire), per_message=True)
        else:
            loop.send()
    assert loop.finished(), (
        f"deadlock: {loop.next}/{len(sizes)} sent, window in flight "
        f"{loop.window.in_flight_msgs} msgs / {loop.window.in_flight_bytes} bytes")
    assert loop.written == list(range(2, len(sizes) + 2))


@settings(max_examples=200, deadline=None)
@given(window=windows, sizes=message_sizes)
def test_window_reopens_when_edge_has_written_all_in_flight(window: tuple[int, int],
                                                            sizes: list[int]) -> None:
    """Worst case for the sender: it fills the window, then the edge writes
    everything and acks arrive. The window must be open again."""
    loop = Loop(sizes, *window)
    while not loop.finished():
        while loop.can_send():
            loop.send()
        while loop.wire:
            loop.receive(1, per_message=True)
        while loop.acks:
            loop.deliver_ack()
        assert loop.window.open or loop.next == len(sizes)
        # What stays unacknowledged is below half a window (at least one).
        assert loop.window.in_flight_bytes < max(1, window[0] // 2)
        assert loop.window.in_flight_msgs < max(1, window[1] // 2)


def test_batched_edge_writes_never_deadlock() -> None:
    # Default session window (64 KiB, 128 msgs), 100-byte chunks, and an edge
    # that drains its session 8 chunks at a time.
    loop = Loop([100] * 200, 64 << 10, 128)
    while not loop.stuck():
        while loop.can_send():
            loop.send()
        while loop.wire:
            loop.receive(8, per_message=False)
        while loop.acks:
            loop.deliver_ack()
    assert loop.finished(), f"stalled after {loop.next} of 200 chunks"
