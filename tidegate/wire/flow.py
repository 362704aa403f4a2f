"""Credit-window flow control between a worker and an edge (sans-I/O).

The worker may have at most ``max_bytes`` bytes and ``max_msgs`` messages of a
stream unacknowledged. The edge acks cumulatively, only after the bytes were
written to the client socket and drained, so a client that stops reading stops
the worker and, through TCP, the backend; nothing buffers more than one window.

:class:`SendWindow` (worker) tracks what is in flight; :class:`AckPolicy` (edge)
acks once half of either window was written since the last ack: one ack per
typical response, and the window fills only if the worker sends the other
half within one NATS round trip.

Invariant (property-tested): a sender that only sends when :meth:`SendWindow.open`
has at most ``max_msgs`` messages and ``max_bytes`` + one message in flight.
"""

from __future__ import annotations

from collections import deque


def first_seq(attempt: int) -> int:
    """The seq of the ``Head`` (tidegate.wire.protocol) of a job's
    ``attempt``-th delivery; every later message of that delivery counts up
    from it.

    Each delivery numbers its messages in a range of its own, above every
    earlier delivery's (``(attempt - 1) * 2**32 + 1`` on; the first starts
    at 1, so the common case costs no byte more on the wire). That range is
    the fencing token: once an edge or a log reader follows a later delivery's
    Head, whatever an earlier one sent late (a fenced worker's buffered
    output, flushed when its link heals) is older than anything expected and
    is dropped as a copy, never taken as the new delivery's text.
    """
    return ((max(attempt, 1) - 1) << 32) + 1


class SendWindow:
    """Worker-side accounting of unacknowledged messages for one stream."""

    __slots__ = ("_held", "_in_flight", "acked_seq", "in_flight_bytes", "max_bytes", "max_msgs",
                 "sent_seq")

    def __init__(self, max_bytes: int, max_msgs: int) -> None:
        if max_bytes < 1 or max_msgs < 1:
            raise ValueError("window sizes must be positive")
        self.max_bytes = max_bytes
        self.max_msgs = max_msgs
        self.sent_seq = 0
        self.acked_seq = 0
        self.in_flight_bytes = 0
        # (seq, nbytes, sent_at, message) of every unacknowledged chunk, oldest
        # first: the message is kept for a retransmit (a core NATS message lost
        # in transit), in the tuple the accounting needs anyway.
        self._in_flight: deque[tuple[int, int, float, bytes]] = deque()
        # (seq, message) of the unacknowledged messages outside the window
        # (Head, heartbeats, Done, Error): a retransmit resends them too.
        self._held: deque[tuple[int, bytes]] = deque()

    @property
    def open(self) -> bool:
        """True while one more message may be sent."""
        return self.in_flight_bytes < self.max_bytes and len(self._in_flight) < self.max_msgs

    @property
    def available_bytes(self) -> int:
        """How many bytes may be read from the backend before the window is full."""
        return max(0, self.max_bytes - self.in_flight_bytes)

    @property
    def in_flight_msgs(self) -> int:
        return len(self._in_flight)

    @property
    def oldest_unacked_at(self) -> float | None:
        """When the oldest unacknowledged message was sent (the caller's clock),
        or None when nothing is in flight. A peer that has not acked for long
        is gone: this is what the ack timeout is measured from."""
        return self._in_flight[0][2] if self._in_flight else None

    @property
    def credit(self) -> int:
        """:attr:`available_bytes` while the window is :attr:`open`, else 0:
        what a pushed stream may hand over now (one call per backend read)."""
        if len(self._in_flight) >= self.max_msgs:
            return 0
        return max(0, self.max_bytes - self.in_flight_bytes)

    def on_send(self, seq: int, nbytes: int, now: float = 0.0, message: bytes = b"") -> bool:
        """Record a chunk ``message`` of ``nbytes`` payload sent with sequence
        ``seq`` (strictly increasing) at time ``now``. Returns :attr:`open`
        after it."""
        if seq <= self.sent_seq:
            raise ValueError(f"sequence {seq} not after {self.sent_seq}")
        self.sent_seq = seq
        in_flight = self._in_flight
        in_flight.append((seq, nbytes, now, message))
        self.in_flight_bytes += nbytes
        return self.in_flight_bytes < self.max_bytes and len(in_flight) < self.max_msgs

    def hold(self, seq: int, message: bytes) -> None:
        """Keep a message sent outside the window until it is acknowledged."""
        self._held.append((seq, message))

    def kept(self, seq: int = 0) -> list[tuple[int, bytes]]:
        """``(seq, message)`` of every kept message from ``seq`` on, in
        sequence order: what a retransmit from ``seq`` sends again."""
        kept = [(s, m) for s, _, _, m in self._in_flight if s >= seq]
        kept.extend((s, m) for s, m in self._held if s >= seq)
        kept.sort(key=lambda pair: pair[0])
        return kept

    @property
    def kept_bytes(self) -> int:
        return sum(len(m) for *_, m in self._in_flight) + sum(len(m) for _, m in self._held)

    def unbound(self) -> None:
        """Stop limiting: what is sent is no longer waiting for a reader's acks
        (a resumable stream whose reader left writes on into its log, which
        holds it; see workers.resumable). The accounting goes on."""
        self.max_bytes = self.max_msgs = 1 << 62

    def on_ack(self, seq: int) -> bool:
        """Apply a cumulative ack. Returns True if it freed anything.

        Stale or duplicate acks (``seq`` at or below the last one) are ignored;
        an ack beyond anything sent is clamped, since it can only come from a
        confused or malicious peer and must not corrupt the accounting.
        """
        held = self._held
        while held and held[0][0] <= seq:  # kept messages outside the window
            held.popleft()
        if seq <= self.acked_seq:
            return False
        seq = min(seq, self.sent_seq)
        self.acked_seq = seq
        freed = False
        while self._in_flight and self._in_flight[0][0] <= seq:
            nbytes = self._in_flight.popleft()[1]
            self.in_flight_bytes -= nbytes
            freed = True
        return freed


class AckPolicy:
    """Edge-side: when to acknowledge what has been written to the client."""

    __slots__ = ("_bytes_threshold", "_msgs_threshold", "acked_seq", "unacked_bytes",
                 "unacked_msgs", "written_seq")

    def __init__(self, window_bytes: int, window_msgs: int) -> None:
        self._bytes_threshold = max(1, window_bytes // 2)
        self._msgs_threshold = max(1, window_msgs // 2)
        self.written_seq = 0
        self.acked_seq = 0
        self.unacked_bytes = 0
        self.unacked_msgs = 0

    def on_written(self, seq: int, nbytes: int, nmsgs: int = 1) -> int | None:
        """Record that messages up to ``seq`` (``nmsgs`` of them, ``nbytes`` of
        payload in all) were written and drained. Returns the seq to
        acknowledge now, or None to wait.

        ``nmsgs`` must count messages, not writes: the worker's window counts
        messages, so counting a coalesced batch as one would let the window
        fill without the edge ever reaching its ack threshold."""
        self.written_seq = seq
        self.unacked_bytes += nbytes
        self.unacked_msgs += nmsgs
        if self.unacked_bytes >= self._bytes_threshold or self.unacked_msgs >= self._msgs_threshold:
            return self.ack_now()
        return None

    def quiet_after(self, nbytes: int, nmsgs: int = 1) -> bool:
        """Whether :meth:`on_written` with these would *not* ask for an ack
        (the edge's direct write path handles only such chunks)."""
        return (self.unacked_bytes + nbytes < self._bytes_threshold
                and self.unacked_msgs + nmsgs < self._msgs_threshold)

    def ack_now(self) -> int:
        self.acked_seq = self.written_seq
        self.unacked_bytes = 0
        self.unacked_msgs = 0
        return self.acked_seq
