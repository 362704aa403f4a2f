"""Adaptive concurrency for one backend (sans-I/O).

A worker's slots are how many streams it runs against its backend;
:class:`AdaptiveLimit` sizes them from the latency the backend shows, as
Envoy's adaptive concurrency and Netflix's gradient limiter do. Signals, per
job: time per output token (at the end) and time to first byte beyond one
whole generation (at the first chunk), each against its uncongested baseline.
A window over ``tolerance`` scales its samples' concurrency down towards
``target``; one under ``target`` grows (doubling in slow start, at most +25 %
after) if the slots were in use; in between nothing moves. Several workers
on one backend settle at one worker's fixed point; a 429/503 halves the limit.

Invariants: time is passed in (``now``), no clock or sleep here; every method
is O(1). How it decides, in full: docs/lifecycle.md#adaptive-concurrency.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from enum import Enum

__all__ = ["AdaptiveLimit", "Phase"]

# A window closes after at least MIN_SAMPLES samples, and after WINDOW
# seconds (SLOW_START_WINDOW in slow start) or as many samples as the limit.
WINDOW = 0.25
SLOW_START_WINDOW = 0.1
MIN_SAMPLES = 3
# Before a generation's length is known (no job completed yet): TTFB may
# exceed its baseline TTFB_LENIENCY times more than TPOT may ...
TTFB_LENIENCY = 3.0
# ... and only its excess beyond this many seconds counts. The worker
# measures TTFB itself, so a burst of new jobs on its own event loop (or a
# busy machine) adds tens of milliseconds that are not the backend's.
TTFB_SLACK = 0.1
TOKENS_EWMA = 0.1  # weight of one completed job in the mean output tokens per job
GROWTH = 0.25  # steady-state growth per window at full headroom
# A window lowers a baseline only at up to this many times the concurrency
# the baseline was measured at (_Signal).
BASE_SPREAD = 2.0


class Phase(Enum):
    SLOW_START = "slow_start"  # doubling until the first congested window
    STEADY = "steady"


class _Signal:
    """One latency signal's window sums and its baseline.

    The baseline is the lowest window mean seen **at a concurrency no higher
    than BASE_SPREAD times the one the baseline was taken at**. More streams
    never make a backend's step faster, so a window that looks faster at a
    much higher concurrency measured the worker's reading, not the backend:
    a worker short of CPU reads a response's first chunk late and the rest in
    a few catch-up reads, and that response's decode time looks short. Seen at
    1,000 streams on a 2-core box: one such window took the TPOT baseline from
    10.1 to 6.8 ms, every later window looked 1.5x congested, and the limit
    sank from 1,024 to its floor of 4 while the backend had room for hundreds.
    """

    __slots__ = ("base", "base_x", "n", "sum", "x_max", "x_sum")

    def __init__(self) -> None:
        self.base = math.inf
        self.base_x = math.inf  # the mean concurrency of the window that set base
        self.n = 0
        self.sum = 0.0
        self.x_sum = 0.0
        self.x_max = 0.0

    def add(self, seconds: float, concurrency: float) -> None:
        self.n += 1
        self.sum += seconds
        self.x_sum += concurrency
        if concurrency > self.x_max:
            self.x_max = concurrency

    def close(self, slack: float = 0.0) -> tuple[float, float, float]:
        """(ratio of the window mean to the baseline, mean concurrency, highest
        concurrency); zeros for an empty window. Lowers the baseline first;
        ``slack`` seconds of excess are forgiven."""
        if not self.n:
            return 0.0, 0.0, 0.0
        mean = self.sum / self.n
        x, x_max = self.x_sum / self.n, self.x_max
        if mean < self.base and x <= BASE_SPREAD * self.base_x:  # base_x inf: no baseline yet
            self.base, self.base_x = mean, x
        ratio = max(self.base, mean - slack) / self.base if self.base > 0 else 1.0
        self.n, self.sum, self.x_sum, self.x_max = 0, 0.0, 0.0, 0.0
        return ratio, x, x_max

    def rebase(self, ratio: float, x: float) -> None:
        """Take the mean of a window that was ``ratio`` above the baseline, at
        concurrency ``x``, as the baseline."""
        if ratio > 1.0 and math.isfinite(self.base):
            self.base *= ratio
            self.base_x = x


class AdaptiveLimit:
    """The concurrency limit of one worker for one backend.

    The caller (the worker pool) reports every job: :meth:`acquire` when it
    takes a slot, :meth:`release` when it frees it; the job itself reports
    :meth:`ttfb` at its first chunk and :meth:`tpot` at its successful end,
    each with the :meth:`mark` it took at the start of the measured interval,
    and :meth:`overload` for a backend's 429/503. :attr:`limit` is the number
    of slots; ``on_change(limit)`` is called whenever it changes.
    """

    __slots__ = ("_area", "_firsts", "_limit", "_next_overload", "_opened", "_started", "_t",
                 "_tokens", "_tpot", "_ttfb", "_window_end", "backend_idle", "decisions",
                 "in_flight", "max_limit", "min_limit", "on_change", "phase", "target",
                 "tolerance")

    def __init__(self, min_limit: int, max_limit: int, *, initial: int | None = None,
                 tolerance: float = 1.3, now: float = 0.0,
                 on_change: Callable[[int], None] | None = None) -> None:
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit <= max_limit, got {min_limit}, {max_limit}")
        if tolerance <= 1.0:
            raise ValueError(f"tolerance must be > 1, got {tolerance}")
        self.min_limit = min_limit
        self.max_limit = max_limit
        self.tolerance = tolerance
        # The dead band [target, tolerance]: half of the tolerance's excess.
        self.target = 1.0 + (tolerance - 1.0) / 2
        start = min_limit if initial is None else initial
        self._limit = float(min(max(start, min_limit), max_limit))
        self.on_change = on_change
        # Where the backend reports its own queue (vLLM's waiting requests,
        # llama.cpp's slots: workers/backends/load_probe.py): True while its
        # latest report says nothing waits in it. A first byte is then late
        # for its prefill (a long uncached prompt), not for a queue: it is
        # no congestion sample. TPOT still is.
        self.backend_idle: Callable[[], bool] | None = None
        self.phase = Phase.SLOW_START
        self.in_flight = 0
        self.decisions = 0  # windows closed (for tests and metrics)
        self._area = 0.0  # integral of in_flight over time, up to _t
        self._t = now
        self._tpot = _Signal()
        self._ttfb = _Signal()
        self._tokens = 0.0  # mean output tokens per completed job (0: none yet)
        self._window_end = now + SLOW_START_WINDOW
        self._opened = now  # when the open window began
        self._started = 0  # jobs acquired since then
        self._firsts = 0  # ... and of those, how many reported their first byte
        self._next_overload = now

    @property
    def limit(self) -> int:
        # Rounded, not truncated: truncation would bias every worker's share
        # down by up to one stream, which adds up over several workers.
        return int(self._limit + 0.5)

    # -- what the worker reports ---------------------------------------------------

    def mark(self, now: float) -> float:
        """The in-flight integral at ``now``: the start of a measured interval."""
        return self._area + self.in_flight * (now - self._t)

    def acquire(self, now: float) -> None:
        self._advance(now)
        self.in_flight += 1
        self._started += 1

    def release(self, now: float) -> None:
        self._advance(now)
        self.in_flight = max(0, self.in_flight - 1)

    def ttfb(self, mark: float, started: float, now: float) -> None:
        """A first byte ``now`` of a backend call started at ``started``
        (``mark``: :meth:`mark` then). Not a sample while the backend says
        nothing waits in it (:attr:`backend_idle`)."""
        idle = self.backend_idle
        if idle is None or not idle():
            self._ttfb.add(now - started, self._concurrency(mark, started, now))
        if started >= self._opened:
            self._firsts += 1
        self._maybe_decide(now)

    def tpot(self, mark: float, first_at: float, tokens: int, now: float,
             stalled: float = 0.0) -> None:
        """A successful end ``now`` of a response whose first chunk came at
        ``first_at`` (``mark`` taken then) and that has ``tokens`` output tokens.

        ``stalled``: seconds of that interval the job did not read the backend
        because its credit window was full (a slow client, a busy edge). That
        wait is the path's, not the backend's decode time: counting it would
        let one slow reader, or an edge short of CPU, shrink every stream's
        limit."""
        self._decoded(mark, first_at, tokens, now - first_at - max(0.0, stalled), now)

    def whole(self, mark: float, started: float, tokens: int, now: float,
              stalled: float = 0.0) -> None:
        """A successful end ``now`` of a *non-streaming* response whose backend
        call started at ``started`` (``mark`` taken then). Its first byte is
        the whole answer, so it gives no TTFB, and its first-chunk-to-end time
        is no decode time (a TPOT of ~0 would become the baseline and make
        every streaming window look congested: seen, a batch of non-streaming
        lines took a limit of 200 down to its floor). Its decode time is the
        whole call less the streaming TTFB baseline (0 before one is known)."""
        base = self._ttfb.base if math.isfinite(self._ttfb.base) else 0.0
        self._decoded(mark, started, tokens, now - started - base - max(0.0, stalled), now)

    def _decoded(self, mark: float, since: float, tokens: int, decoding: float,
                 now: float) -> None:
        """One decode sample: ``tokens`` output tokens in ``decoding`` seconds
        of an interval that began at ``since``; it also moves the mean
        response length the generation-time bound uses."""
        if tokens > 1 and decoding > 0:
            self._tokens = (float(tokens) if not self._tokens
                            else self._tokens + TOKENS_EWMA * (tokens - self._tokens))
            self._tpot.add(decoding / (tokens - 1), self._concurrency(mark, since, now))
            self._maybe_decide(now)

    def overload(self, now: float) -> None:
        """The backend refused for load (429, 503): halve, once per window."""
        if now < self._next_overload:
            return
        self._next_overload = now + WINDOW
        self.phase = Phase.STEADY
        self._set(min(self._limit, max(1.0, float(self.in_flight))) / 2)

    # -- the controller -------------------------------------------------------------

    def _advance(self, now: float) -> None:
        if now > self._t:
            self._area += self.in_flight * (now - self._t)
            self._t = now

    def _concurrency(self, mark: float, since: float, now: float) -> float:
        if now <= since:
            return float(max(1, self.in_flight))
        return max(1.0, (self.mark(now) - mark) / (now - since))

    def _maybe_decide(self, now: float) -> None:
        n = self._tpot.n + self._ttfb.n
        # A window is WINDOW long, or as many samples as the limit when they
        # come sooner. In slow start it also closes once every job it let in
        # has had its first byte: one doubling per round of first bytes. A
        # window waits for a sample to close it, and after that round the
        # next one is a generation's end, which made a fresh worker's first
        # burst wait whole generations (8x a warm one's first tokens).
        caught_up = self.phase is Phase.SLOW_START and 0 < self._started <= self._firsts
        if n < MIN_SAMPLES or (now < self._window_end and n < self._limit and not caught_up):
            return
        self.decisions += 1
        self._opened, self._started, self._firsts = now, 0, 0
        tpot_ratio, tpot_x, tpot_top = self._tpot.close()
        ttfb_ratio, ttfb_x, ttfb_top = self._ttfb.close()
        ttfb_c = self._ttfb_congestion(ttfb_ratio)
        c, x = (tpot_ratio, tpot_x) if tpot_ratio >= ttfb_c else (ttfb_c, ttfb_x)
        self._decide(c, x, max(tpot_top, ttfb_top), tpot_ratio, ttfb_ratio)
        self._window_end = now + (SLOW_START_WINDOW if self.phase is Phase.SLOW_START
                                  else WINDOW)

    def _ttfb_congestion(self, ratio: float) -> float:
        """TTFB's window ratio as a congestion on TPOT's scale (module docstring):
        only a wait beyond one generation counts; 0.0 for an empty window."""
        if not ratio:
            return 0.0
        if not self._ttfb.base > 0:  # first bytes in no time: nothing to compare
            return 1.0
        excess = (ratio - 1.0) * self._ttfb.base
        gen = self._tpot.base * self._tokens
        if self.phase is Phase.STEADY and self._tokens and math.isfinite(gen) and gen > 0:
            return 1.0 + max(0.0, excess - gen) / gen
        return 1.0 + max(0.0, excess - TTFB_SLACK) / self._ttfb.base / TTFB_LENIENCY

    def _decide(self, c: float, x: float, x_max: float, tpot_ratio: float,
                ttfb_ratio: float) -> None:
        """``c``: the window's congestion, ``x``: the mean concurrency its
        worse signal saw; ``x_max``: the highest any sample saw (when growing:
        latency was fine up to there; the window's samples mix jobs started
        before and after the last change, and the newest are the evidence)."""
        if c > self.tolerance:
            self.phase = Phase.STEADY
            if self._limit <= self.min_limit:
                # Slow even at the floor: that is this backend's normal now.
                self._tpot.rebase(tpot_ratio, x)
                self._ttfb.rebase(ttfb_ratio, x)
                return
            self._set(min(self._limit, max(x * self.target / c, self._limit / 2)))
        elif c < self.target:
            # Growth is relative to what was in use: the limit itself once
            # every slot was taken (so a small limit grows by fractions that
            # add up), else the highest concurrency the samples saw.
            used = self._limit if x_max >= self.limit - 0.5 else x_max
            if self.phase is Phase.SLOW_START:
                self._set(max(self._limit, 2 * used))
            else:
                headroom = min(1.0, (self.target - c) / (self.target - 1.0))
                self._set(max(self._limit, used * (1.0 + GROWTH * headroom)))
        else:
            self.phase = Phase.STEADY

    def _set(self, limit: float) -> None:
        before = self.limit
        self._limit = min(max(limit, float(self.min_limit)), float(self.max_limit))
        if self.limit != before and self.on_change is not None:
            self.on_change(self.limit)
