"""The adaptive concurrency controller (workers.limiter), without I/O.

Unit tests drive it call by call; the property tests run it against a
simulated backend (:class:`SimBackend`): a GPU-like server whose step time
(prefill and per token) is flat up to ``K`` concurrent streams and grows in
proportion past it, shared by ``N`` workers that each pull from one backlog
only when their own limiter has a free slot, as workers/service.py does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from workers.limiter import MIN_SAMPLES, WINDOW, AdaptiveLimit, Phase

DT = 0.01  # simulation step, seconds


@dataclass(slots=True)
class _Job:
    limit: AdaptiveLimit
    started: float
    mark: float
    prefill: float  # seconds of uncongested prefill left
    tokens_left: float
    tokens: int
    first_at: float = 0.0


@dataclass
class SimBackend:
    """Workers (one limiter each) in front of one backend saturating at ``k``."""

    k: int
    workers: int = 1
    min_limit: int = 2
    max_limit: int = 1024
    ttft: float = 0.05
    itl: float = 0.01
    tokens: int = 32
    demand: int = 10**9  # closed loop: at most this many jobs in the system at once
    noise: float = 0.0  # +-fraction of random jitter on every step's speed
    slowdown: float = 1.0  # a backend-wide factor on every latency (drift tests)
    seed: int = 0
    initial: int | None = None
    now: float = 0.0
    limits: list[AdaptiveLimit] = field(default_factory=list)
    jobs: list[_Job] = field(default_factory=list)
    history: list[int] = field(default_factory=list)  # total in flight per step
    limit_history: list[int] = field(default_factory=list)  # sum of limits per step

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.limits = [AdaptiveLimit(self.min_limit, self.max_limit, initial=self.initial,
                                     now=0.0) for _ in range(self.workers)]

    def factor(self) -> float:
        return self.slowdown * max(1.0, len(self.jobs) / self.k)

    def step(self) -> None:
        now = self.now
        # Pull: each worker fills its free slots from the shared backlog.
        for limit in self.limits:
            while limit.in_flight < limit.limit and len(self.jobs) < self.demand:
                limit.acquire(now)
                self.jobs.append(_Job(limit, now, limit.mark(now), self.ttft, self.tokens,
                                      self.tokens))
        self.history.append(len(self.jobs))
        self.limit_history.append(sum(lim.limit for lim in self.limits))
        f = self.factor()
        self.now = now = now + DT
        done: list[_Job] = []
        for job in self.jobs:
            speed = 1.0 / (f * (1.0 + self.noise * (2 * self.rng.random() - 1)))
            if job.prefill > 0:
                job.prefill -= DT * speed
                if job.prefill <= 0:
                    job.first_at = now
                    job.limit.ttfb(job.mark, job.started, now)
                    job.mark = job.limit.mark(now)
                continue
            job.tokens_left -= DT * speed / self.itl
            if job.tokens_left <= 1:  # the first token came with the first byte
                done.append(job)
        for job in done:
            self.jobs.remove(job)
            job.limit.tpot(job.mark, job.first_at, job.tokens, now)
            job.limit.release(now)

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / DT)):
            self.step()

    def mean_in_flight(self, last_seconds: float) -> float:
        tail = self.history[-round(last_seconds / DT):]
        return sum(tail) / len(tail)


# -- unit tests -------------------------------------------------------------------


def test_starts_at_the_floor_and_validates_bounds() -> None:
    assert AdaptiveLimit(4, 100).limit == 4
    assert AdaptiveLimit(4, 100, initial=500).limit == 100
    assert AdaptiveLimit(4, 100, initial=1).limit == 4
    with pytest.raises(ValueError, match="min_limit"):
        AdaptiveLimit(0, 10)
    with pytest.raises(ValueError, match="min_limit"):
        AdaptiveLimit(10, 5)
    with pytest.raises(ValueError, match="tolerance"):
        AdaptiveLimit(1, 5, tolerance=1.0)


def _fill(limit: AdaptiveLimit, n: int, now: float) -> list[float]:
    marks = []
    for _ in range(n):
        limit.acquire(now)
        marks.append(limit.mark(now))
    return marks


def test_slow_start_doubles_when_the_slots_are_used_and_latency_is_flat() -> None:
    changes: list[int] = []
    limit = AdaptiveLimit(4, 1000, now=0.0, on_change=changes.append)
    marks = _fill(limit, 4, 0.0)
    for i, mark in enumerate(marks):  # first bytes at 50 ms, the window closes at 0.25 s
        limit.ttfb(mark, 0.0, 0.05 if i < 3 else WINDOW)
    assert limit.decisions == 1
    assert limit.limit == 8
    assert changes == [8]
    assert limit.phase is Phase.SLOW_START


def test_no_growth_without_demand() -> None:
    """One stream in flight under a limit of 8: flat latency is no reason to grow."""
    limit = AdaptiveLimit(8, 1000, now=0.0)
    t = 0.0
    for _ in range(20):
        limit.acquire(t)
        mark = limit.mark(t)
        t += 0.05
        limit.ttfb(mark, t - 0.05, t)
        limit.release(t)
        t += 0.05
    assert limit.decisions >= 2
    assert limit.limit == 8


def test_a_window_needs_time_and_samples() -> None:
    limit = AdaptiveLimit(4, 100, now=0.0)
    marks = _fill(limit, 4, 0.0)
    limit.ttfb(marks[0], 0.0, 1.0)
    limit.ttfb(marks[1], 0.0, 1.0)
    assert limit.decisions == 0  # late enough, but only two samples
    limit.ttfb(marks[2], 0.0, 1.0)
    assert limit.decisions == 1
    assert MIN_SAMPLES == 3


def test_congestion_scales_the_concurrency_the_samples_saw() -> None:
    """TPOT twice its baseline at 40 streams: the limit goes to 40 x target / 2,
    at most halving per window."""
    limit = AdaptiveLimit(1, 1000, initial=40, now=0.0)
    _fill(limit, 40, 0.0)
    for _ in range(3):  # baseline window: 10 ms per token at 40 streams
        limit.tpot(limit.mark(WINDOW - 0.1), WINDOW - 0.1, 11, WINDOW)
    assert limit.decisions == 1
    assert limit.limit == 80  # slow start: all 40 slots in use and latency flat
    t = 1.0
    for _ in range(3):  # 20 ms per token: c = 2
        limit.tpot(limit.mark(t - 0.2), t - 0.2, 11, t)
    assert limit.phase is Phase.STEADY
    assert limit.limit == 40  # 40 x 1.15 / 2 = 23, but at most halving (from 80)
    t += WINDOW
    for _ in range(3):
        limit.tpot(limit.mark(t - 0.2), t - 0.2, 11, t)
    assert limit.limit == int(40 * limit.target / 2)


def test_stale_congested_samples_do_not_push_the_limit_further_down() -> None:
    limit = AdaptiveLimit(1, 1000, initial=40, now=0.0)
    _fill(limit, 40, 0.0)
    for _ in range(3):  # baseline: 10 ms per token at 40 streams
        limit.tpot(limit.mark(WINDOW - 0.1), WINDOW - 0.1, 11, WINDOW)
    assert limit.limit == 80
    for _ in range(3):  # a window in the dead band ends slow start without a change
        limit.tpot(limit.mark(0.4), 0.4, 11, 0.4 + 0.12)
    assert (limit.limit, limit.phase) == (80, Phase.STEADY)
    for _ in range(3):  # 20 ms per token: at most halving, to 40
        limit.tpot(limit.mark(0.6), 0.6, 11, 0.8)
    assert (limit.limit, limit.phase) == (40, Phase.STEADY)
    t = 1.1
    for _ in range(3):
        limit.tpot(limit.mark(t - 0.2), t - 0.2, 11, t)  # 20 ms: to 40 x 1.15 / 2 = 23
    after_first = limit.limit
    assert after_first == 23
    # More samples of jobs that ran at 40 concurrent (the in-flight count has
    # not come down yet): the same estimate, so the limit stays.
    for step in range(1, 4):
        t = 1.1 + step * WINDOW
        for _ in range(3):
            limit.tpot(limit.mark(t - 0.2), t - 0.2, 11, t)
        assert limit.limit == after_first


def test_overload_halves_at_most_once_per_window() -> None:
    limit = AdaptiveLimit(1, 1000, initial=64, now=0.0)
    _fill(limit, 64, 0.0)
    limit.overload(1.0)
    assert limit.limit == 32
    limit.overload(1.0 + WINDOW / 2)
    assert limit.limit == 32
    limit.overload(1.0 + WINDOW)
    assert limit.limit == 16  # a window later: half of min(limit, in flight)
    assert limit.phase is Phase.STEADY


def test_overload_at_the_floor_stays_at_the_floor() -> None:
    limit = AdaptiveLimit(3, 10, now=0.0)
    limit.acquire(0.0)
    limit.overload(0.0)
    assert limit.limit == 3


def test_mark_integrates_in_flight_over_time() -> None:
    limit = AdaptiveLimit(1, 10, now=0.0)
    start = limit.mark(0.0)
    limit.acquire(0.0)
    limit.acquire(1.0)  # 1 in flight for 1 s
    limit.release(3.0)  # 2 in flight for 2 s
    assert limit.mark(4.0) - start == pytest.approx(1 + 4 + 1)


# -- against a simulated backend ----------------------------------------------------


def test_capacity_to_spare_lets_every_waiting_job_run() -> None:
    """No saturation within reach: 300 jobs at once all run within seconds."""
    sim = SimBackend(k=10**6, demand=300, min_limit=4)
    sim.run(4.0)
    assert sim.history[-1] == 300
    assert min(sim.history[-100:]) == 300  # and they keep running, nothing waits
    assert sim.limits[0].limit >= 300


def test_saturating_backend_settles_between_k_and_one_and_a_half_k() -> None:
    sim = SimBackend(k=20, min_limit=2)
    sim.run(12.0)
    assert 20 <= sim.mean_in_flight(6.0) <= 30
    assert sim.limits[0].limit <= 30


def test_backs_off_when_the_backend_loses_capacity() -> None:
    """Settled in front of K = 100, the backend drops to K = 10 (a neighbour
    took the GPU): the limit comes down to it."""
    sim = SimBackend(k=100, min_limit=2)
    sim.run(6.0)
    assert 100 <= sim.mean_in_flight(2.0) <= 150
    sim.k = 10
    # The limit drops at once, the in-flight count as its (now 10x slower) jobs end.
    sim.run(12.0)
    assert 10 <= sim.mean_in_flight(4.0) <= 15


def test_a_backend_that_got_slower_for_good_is_rebased() -> None:
    """Every latency triples at t=5 s, whatever the concurrency. Congested
    windows at the floor move the baseline up until the limit can grow again."""
    sim = SimBackend(k=16, min_limit=2)
    sim.run(5.0)
    before = sim.mean_in_flight(2.0)
    sim.slowdown = 3.0
    sim.run(25.0)
    assert before >= 16
    assert 16 <= sim.mean_in_flight(5.0) <= 24


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(k=st.integers(min_value=8, max_value=48), workers=st.integers(min_value=1, max_value=3),
       seed=st.integers(min_value=0, max_value=2**16), noise=st.sampled_from([0.0, 0.05]))
def test_property_converges_into_k_to_one_and_a_half_k(k: int, workers: int, seed: int,
                                                       noise: float) -> None:
    """Whatever K, however many workers share the backend: their total in
    flight settles within [K, 1.5 K] (the fixed point does not grow with N),
    and its peaks stay within 1.5 K plus one stream per worker (a worker's
    slots are whole streams: with K = 9 over 3 workers, one step is a third
    of a share)."""
    sim = SimBackend(k=k, workers=workers, min_limit=1, seed=seed, noise=noise)
    sim.run(12.0)
    mean = sim.mean_in_flight(5.0)
    assert k <= mean <= 1.5 * k, (mean, k, workers)
    assert max(sim.history[-500:]) <= 1.5 * k + workers


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(demand=st.integers(min_value=1, max_value=400), workers=st.integers(1, 3))
def test_property_grows_to_the_demand_when_there_is_headroom(demand: int, workers: int) -> None:
    """No saturation: in-flight reaches the demand (nothing waits that could
    run), and the limits do not run away from it towards max_limit."""
    sim = SimBackend(k=10**6, demand=demand, workers=workers, min_limit=1)
    sim.run(5.0)
    assert min(sim.history[-50:]) == demand
    assert sim.limit_history[-1] <= 4 * demand + 2 * workers


@settings(max_examples=60, deadline=None)
@given(lo=st.integers(1, 8), span=st.integers(0, 100),
       ops=st.lists(st.tuples(st.sampled_from(["acquire", "release", "ttfb", "tpot",
                                               "overload"]),
                              st.floats(0.0, 2.0), st.floats(0.0, 5.0),
                              st.integers(0, 5000)), max_size=200))
def test_property_always_within_bounds(lo: int, span: int,
                                       ops: list[tuple[str, float, float, int]]) -> None:
    """Any sequence of events, any latencies: the limit stays within
    [min_limit, max_limit] and on_change reports exactly the changes."""
    hi = lo + span
    seen: list[int] = []
    limit = AdaptiveLimit(lo, hi, on_change=seen.append)
    now = 0.0
    last = limit.limit
    for op, dt, latency, tokens in ops:
        now += dt
        if op == "acquire":
            limit.acquire(now)
        elif op == "release":
            limit.release(now)
        elif op == "ttfb":
            limit.ttfb(limit.mark(now), now, now + latency)
        elif op == "tpot":
            limit.tpot(limit.mark(now), now, tokens, now + latency)
        else:
            limit.overload(now)
        assert lo <= limit.limit <= hi
        assert limit.in_flight >= 0
        if limit.limit != last:
            assert seen[-1] == limit.limit
            last = limit.limit


def test_a_queueing_backend_is_seen_by_ttfb_alone() -> None:
    """A backend that queues what it cannot run (Ollama's NUM_PARALLEL, a
    full llama.cpp): TPOT stays flat, TTFB grows by whole generations."""
    limit = AdaptiveLimit(1, 1000, initial=16, now=0.0)
    _fill(limit, 16, 0.0)
    t = 0.0
    for _ in range(3):  # baseline: 50 ms to first byte
        limit.ttfb(limit.mark(t), t, t + 0.05)
    limit.tpot(limit.mark(0.5), 0.5, 51, 1.0)  # 10 ms per token; closes the window
    assert limit.limit == 32  # slow start: all was fine at 16
    for t in (1.5, 2.0):
        limit.tpot(limit.mark(t - 0.5), t - 0.5, 51, t)  # still 10 ms per token
        for _ in range(3):  # but first bytes after 2 s in the backend's queue
            limit.ttfb(limit.mark(t - 2.0), t - 2.0, t)
    assert limit.phase is Phase.STEADY
    assert limit.limit == 8  # halved twice (32 -> 16 -> 8): at most halving per window


def test_late_first_bytes_are_no_congestion_while_the_backend_says_nothing_waits() -> None:
    """The same first bytes two seconds late as in the queueing backend
    above, from a backend that reports an empty queue (vLLM's waiting
    requests at 0): long uncached prompts prefilling, not a queue. The limit
    holds; once the backend reports requests waiting, the same samples count."""
    def run(idle: bool) -> int:
        limit = AdaptiveLimit(1, 1000, initial=16, now=0.0)
        limit.backend_idle = lambda: idle
        _fill(limit, 16, 0.0)
        t = 0.0
        for _ in range(3):  # baseline: 50 ms to first byte
            limit.ttfb(limit.mark(t), t, t + 0.05)
        limit.tpot(limit.mark(0.5), 0.5, 51, 1.0)
        for t in (1.5, 2.0):
            limit.tpot(limit.mark(t - 0.5), t - 0.5, 51, t)
            for _ in range(3):
                limit.ttfb(limit.mark(t - 2.0), t - 2.0, t)
        return limit.limit

    assert run(idle=False) == 8  # as test_a_queueing_backend_is_seen_by_ttfb_alone
    assert run(idle=True) >= 32


def test_late_first_bytes_at_a_steady_decode_pace_do_not_shrink_the_limit() -> None:
    """A loaded path (a 2-core box, the worker's loop starting a burst of
    jobs) delays first bytes by hundreds of ms while the backend decodes at
    its uncongested pace: less than one generation of wait is not a queue in
    the backend, so the limit holds. The same first bytes later than a whole
    generation do shrink it."""
    limit = AdaptiveLimit(1, 1000, initial=64, now=0.0)
    _fill(limit, 64, 0.0)
    t = 0.0
    for _ in range(3):  # baseline: 50 ms to first byte
        limit.ttfb(limit.mark(t), t, t + 0.05)
    limit.tpot(limit.mark(0.5), 0.5, 51, 1.0)  # 10 ms per token: a generation is 0.5 s
    assert limit.limit == 128  # slow start: all was fine at 64
    limit.overload(1.0)  # leave slow start: half the 64 in flight
    held = limit.limit
    for t in (1.5, 2.0, 2.5, 3.0):
        limit.tpot(limit.mark(t - 0.5), t - 0.5, 51, t)  # still 10 ms per token
        for _ in range(3):  # first bytes 400 ms late: 9x the baseline
            limit.ttfb(limit.mark(t - 0.45), t - 0.45, t)
    assert limit.limit >= held
    grown = limit.limit
    for t in (3.5, 4.0):
        limit.tpot(limit.mark(t - 0.5), t - 0.5, 51, t)
        for _ in range(3):  # 1.5 s late: three generations of queue in the backend
            limit.ttfb(limit.mark(t - 1.55), t - 1.55, t)
    assert limit.limit < grown


def test_time_stalled_on_the_credit_window_is_not_decode_time() -> None:
    """A job that waited on its window (a slow client, an edge short of CPU)
    did not read the backend meanwhile: with the stall left out its TPOT is
    the backend's 10 ms and the limit grows; counted in, the same jobs would
    look 3x congested and shrink it."""
    def run(stalled: float) -> int:
        limit = AdaptiveLimit(1, 1000, initial=64, now=0.0)
        _fill(limit, 64, 0.0)
        for _ in range(3):  # the baseline: 51 tokens in 0.5 s, 10 ms each
            limit.tpot(limit.mark(0.0), 0.0, 51, 0.5)
        limit.overload(0.5)  # steady state, 32 slots
        for t in (1.0, 2.0, 3.0, 4.0):
            for _ in range(3):  # 51 tokens in 1.5 s, 1 s of it stalled on the window
                limit.tpot(limit.mark(t - 1.5), t - 1.5, 51, t + 0.01, stalled=stalled)
        return limit.limit

    assert run(stalled=1.0) > 32
    assert run(stalled=0.0) < 32


def test_non_streaming_jobs_grow_the_limit_without_spoiling_the_baseline() -> None:
    """A batch of non-streaming jobs (one 'chunk': the whole answer) grows
    the limit from the floor, and streaming jobs at the same pace afterwards
    are not congestion: the non-streaming samples are decode time (whole
    call less the TTFB baseline), not the ~0 between first byte and end."""
    limit = AdaptiveLimit(4, 1000, now=0.0)
    _fill(limit, 4, 0.0)
    for _ in range(3):  # streaming: 50 ms to first byte
        limit.ttfb(limit.mark(0.0), 0.0, 0.05)
    t = 0.1
    for _ in range(8):  # rounds of non-streaming jobs: 0.05 s + 50 tokens x 10 ms
        n = limit.limit
        _fill(limit, n - limit.in_flight, t)
        for _ in range(n):
            limit.whole(limit.mark(t), t, 51, t + 0.55)
            limit.release(t + 0.55)
        t += 0.6
    grown = limit.limit
    assert grown >= 64
    _fill(limit, grown, t)
    for _ in range(2):  # streaming at the same 10 ms per token: no shrink
        for _ in range(4):
            limit.tpot(limit.mark(t), t, 51, t + 0.5)
        t += 0.5
    assert limit.limit >= grown


def test_tens_of_ms_of_ttfb_jitter_are_not_congestion() -> None:
    """A burst of job starts delays first bytes on the worker's own loop by
    tens of ms: with a 20 ms baseline that is a large ratio, but within the
    slack, so the limit keeps growing."""
    limit = AdaptiveLimit(4, 1000, now=0.0)
    _fill(limit, 4, 0.0)
    for _ in range(4):
        limit.ttfb(limit.mark(0.0), 0.0, 0.02)
    grown = limit.limit
    assert grown == 8
    _fill(limit, 4, 0.1)
    for _ in range(8):  # 80 ms: 4x the baseline, 60 ms of excess
        limit.ttfb(limit.mark(0.12), 0.12, 0.2)
    assert limit.limit > grown




def _windows(limit: AdaptiveLimit, t: float, streams: int | None, seconds_per_51: float,
             n: int) -> float:
    """``n`` windows of three responses of 51 tokens, each taking
    ``seconds_per_51``, at exactly ``streams`` in flight (None: as many as the
    limit allows, as a worker with a backlog runs); returns the time after."""
    for _ in range(n):
        want = limit.limit if streams is None else streams
        for _ in range(limit.in_flight - want):
            limit.release(t)
        if limit.in_flight < want:
            _fill(limit, want - limit.in_flight, t)
        t += max(WINDOW, seconds_per_51) + 0.01
        for _ in range(MIN_SAMPLES):
            limit.tpot(limit.mark(t - seconds_per_51), t - seconds_per_51, 51, t)
    return t


def test_a_catch_up_window_at_high_concurrency_does_not_lower_the_baseline() -> None:
    """A worker short of CPU reads a response's first chunk late and the rest
    in a few catch-up reads: its decode time looks short. Such a window at a
    concurrency far above the baseline's must not become the baseline, or
    every later window at the backend's real pace looks congested and the
    limit sinks to its floor (seen at 1,000 streams: 10.1 -> 6.8 ms, 1,024 ->
    4 streams)."""
    limit = AdaptiveLimit(4, 1024, initial=8, now=0.0)
    t = _windows(limit, 0.0, None, 0.5, 7)  # slow start at 10 ms a token: 8 -> 1024
    assert limit.limit == 1024
    t = _windows(limit, t, 512, 0.34, 1)  # 512 streams, catch-up reads: "6.8 ms" a token
    t = _windows(limit, t, 512, 0.5, 1)  # the real 10 ms at 512: leaves slow start
    held = limit.limit
    _windows(limit, t, None, 0.5, 8)  # the backend's real 10 ms, as many as allowed
    assert limit.limit >= held  # 10 ms is the baseline's pace: no congestion


def test_a_faster_window_near_the_baselines_concurrency_lowers_it() -> None:
    """At about the concurrency the baseline was measured at, a faster window
    is the backend's real floor: it becomes the baseline, and the old pace is
    congestion from then on."""
    limit = AdaptiveLimit(1, 1024, initial=32, now=0.0)
    t = _windows(limit, 0.0, 32, 0.5, 1)  # the baseline: 10 ms a token at 32 streams
    limit.overload(t)  # steady state: 16
    t = _windows(limit, t, None, 0.2, 1)  # 4 ms a token at 16 streams
    held = limit.limit
    _windows(limit, t, None, 0.5, 3)  # 10 ms again: 2.5x the new baseline
    assert limit.limit < held


def test_slow_start_doubles_per_round_of_first_bytes_not_per_generation() -> None:
    """A burst of 32 on a fresh worker (64-token streams at 10 ms a token, 50
    ms to the first): each doubling waits for the first bytes of the jobs the
    last one let in, not for a window's length of further samples. Before,
    a window left open past its end by the last first byte closed only at
    the first generation's end: a fresh `tidegate up` gave a burst's first
    tokens 8x later than a warm one (bench.first_burst)."""
    sim = SimBackend(k=64, min_limit=4, demand=32, tokens=64)
    sim.run(0.4)  # 0.05 s per round of first bytes: 4 -> 8 -> 16 -> 32 well within
    assert sim.limits[0].limit >= 32, sim.limit_history[::5]
    assert sim.limits[0].phase is Phase.SLOW_START
