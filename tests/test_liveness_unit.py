"""The liveness probe's rules (tidegate.broker.liveness) on a virtual clock.

A scripted NATS client answers each probe as a live, dead, unreachable or
crashing worker would; the clock moves only when a probe waits or the probe
loop sleeps, so every time asserted here is exact and nothing depends on the
machine's speed. The rules against a real nats-server: tests/test_presence.py,
tests/test_log_continuation.py, tests/test_failover.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace

import nats.errors
import pytest

from tidegate.broker import liveness
from tidegate.broker.liveness import ANSWER_WITHIN, CONFIRM_AFTER, WorkerWatch, nobody_at, runs

START = 100.0  # not 0: a time added where it should be subtracted shows
_real_sleep = asyncio.sleep

# What one probe meets: an exception to raise, bytes to answer with, or a
# callable taking the request's timeout (it may move the clock).
Answer = BaseException | bytes | Callable[[float], object]


class Clock:
    def __init__(self, early: float = 0.0) -> None:
        self.now = START
        self.early = early  # how early every timer fires (the loop rounds)

    async def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds - self.early)
        await _real_sleep(0)


class ScriptedNats:
    """Answers the n-th request with ``script(n, clock)``; records each
    request as (time, subject, payload, timeout)."""

    def __init__(self, clock: Clock, script: Callable[[int], Answer]) -> None:
        self.clock = clock
        self.script = script
        self.requests: list[tuple[float, str, bytes, float]] = []

    async def request(self, subject: str, payload: bytes,
                      timeout: float) -> SimpleNamespace:  # noqa: ASYNC109 (nats' signature)
        n = len(self.requests)
        self.requests.append((self.clock.now, subject, payload, timeout))
        await _real_sleep(0)
        answer = self.script(n)
        if callable(answer):
            answer = answer(timeout)
        if isinstance(answer, BaseException):
            raise answer
        assert isinstance(answer, bytes)
        return SimpleNamespace(data=answer)


def timed_out(clock: Clock) -> Callable[[float], BaseException]:
    """A live worker's answer to a probe: none, the request times out."""
    def wait(timeout: float) -> BaseException:
        clock.now += timeout
        return nats.errors.TimeoutError()
    return wait


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(liveness.time, "monotonic", lambda: c.now)
    monkeypatch.setattr(liveness.asyncio, "sleep", c.sleep)
    return c


class Followers:
    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.lost: list[tuple[str, str, float]] = []

    def make(self, name: str) -> object:
        outer = self

        class One:
            def worker_lost(self, control: str) -> None:
                outer.lost.append((name, control, outer.clock.now))
        return One()


async def settle(until: Callable[[], bool], steps: int = 2000) -> None:
    for _ in range(steps):
        if until():
            return
        await _real_sleep(0)


# --------------------------------------------------------------------------
# nobody_at: one probe
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("answer", "verdict"), [
    (nats.errors.NoRespondersError(), True),
    (nats.errors.TimeoutError(), False),
    (b"", False),  # answered: somebody is there
    (TimeoutError(), None),
    (nats.errors.ConnectionClosedError(), None),
    (OSError(), None),
])
async def test_one_probe(clock: Clock, answer: Answer, verdict: bool | None) -> None:
    nc = ScriptedNats(clock, lambda n: answer)
    assert await nobody_at(nc, "tg.ctl.w1", 0.2) is verdict  # type: ignore[arg-type]
    assert [r[1:] for r in nc.requests] == [("tg.ctl.w1", b"", 0.2)]


# --------------------------------------------------------------------------
# runs: what a worker says of one job
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("answer", "said"), [
    (b"0", liveness.GONE), (b"2", liveness.ENDED), (b"1", liveness.RUNNING),
    (b"", liveness.RUNNING), (nats.errors.TimeoutError(), liveness.RUNNING),
])
async def test_a_worker_answers_for_a_job(clock: Clock, answer: Answer, said: str) -> None:
    nc = ScriptedNats(clock, lambda n: answer)
    assert await runs(nc, "tg.live.w1", "req-1", 0.2) == said  # type: ignore[arg-type]
    assert [r[1:] for r in nc.requests] == [("tg.live.w1", b"req-1", ANSWER_WITHIN)]


async def test_a_worker_nobody_subscribes_for_is_gone_after_the_confirmation(
        clock: Clock) -> None:
    nc = ScriptedNats(clock, lambda n: nats.errors.NoRespondersError())
    assert await runs(nc, "tg.live.w1", "r", 0.2) == liveness.GONE  # type: ignore[arg-type]
    times = [round(t - START, 6) for t, *_ in nc.requests]
    assert times == [0.0, 0.2, 0.4, 0.6]  # a probe every interval, gone at CONFIRM_AFTER


async def test_a_probe_that_could_not_ask_starts_the_confirmation_again(clock: Clock) -> None:
    def script(n: int) -> Answer:
        return OSError() if n == 2 else nats.errors.NoRespondersError()
    nc = ScriptedNats(clock, script)
    assert await runs(nc, "tg.live.w1", "r", 0.2) == liveness.GONE  # type: ignore[arg-type]
    # absent at 0 and 0.2, no evidence at 0.4, absent again from 0.6: gone at 1.2
    assert round(nc.requests[-1][0] - START, 6) == 1.2
    assert len(nc.requests) == 7


async def test_who_cannot_ask_says_nothing(clock: Clock) -> None:
    nc = ScriptedNats(clock, lambda n: nats.errors.ConnectionClosedError())
    assert await runs(nc, "tg.live.w1", "r", 0.2) is None  # type: ignore[arg-type]
    assert round(clock.now - START, 6) >= 4 * CONFIRM_AFTER
    assert len(nc.requests) == round(4 * CONFIRM_AFTER / 0.2)


async def test_a_slow_answer_costs_no_extra_wait(clock: Clock) -> None:
    """The interval counts from a probe's start: one that took 0.15 s of a
    0.2 s interval is followed 0.05 s later."""
    def slow_gone(timeout: float) -> BaseException:
        clock.now += 0.15
        return nats.errors.NoRespondersError()
    nc = ScriptedNats(clock, lambda n: slow_gone)
    assert await runs(nc, "tg.live.w1", "r", 0.2) == liveness.GONE  # type: ignore[arg-type]
    assert [round(t - START, 6) for t, *_ in nc.requests] == [0.0, 0.2, 0.4, 0.6]


# --------------------------------------------------------------------------
# WorkerWatch: one probe per followed worker, every follower told
# --------------------------------------------------------------------------


async def test_nothing_is_probed_when_disabled_or_for_no_worker(clock: Clock) -> None:
    nc = ScriptedNats(clock, lambda n: nats.errors.NoRespondersError())
    off = WorkerWatch(nc, 0.0)  # type: ignore[arg-type]
    off.follow(Followers(clock).make("a"), "tg.ctl.w1")  # type: ignore[arg-type]
    on = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    on.follow(Followers(clock).make("a"), "")  # type: ignore[arg-type]
    await _real_sleep(0)
    assert (off.following(), on.following(), nc.requests) == ([], [], [])


async def test_a_death_is_told_once_to_every_follower(clock: Clock) -> None:
    def script(n: int) -> Answer:
        return timed_out(clock) if n < 2 else nats.errors.NoRespondersError()
    nc = ScriptedNats(clock, script)
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    watch.follow(seen.make("a"), "tg.ctl.w1")  # type: ignore[arg-type]
    watch.follow(seen.make("b"), "tg.ctl.w1")  # type: ignore[arg-type]
    assert watch.following() == ["tg.ctl.w1"]
    assert watch.lost_total == 0
    await settle(lambda: bool(seen.lost))
    # alive at 0 and 0.2 (each probe waits out its interval), nobody from 0.4
    assert sorted(seen.lost) == [("a", "tg.ctl.w1", pytest.approx(START + 1.0)),
                                 ("b", "tg.ctl.w1", pytest.approx(START + 1.0))]
    assert {r[1:] for r in nc.requests} == {("tg.ctl.w1", b"", 0.2)}, "one probe for both"
    assert [round(t - START, 6) for t, *_ in nc.requests] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert watch.lost_total == 1
    assert watch.following() == []
    assert not watch._probes, "the dead worker's probe is forgotten"
    watch.close()


async def test_an_answer_in_between_starts_the_confirmation_again(clock: Clock) -> None:
    """A subscription dropped and made again (a reconnect) is no death."""
    def script(n: int) -> Answer:
        return b"" if n == 2 else nats.errors.NoRespondersError()
    nc = ScriptedNats(clock, script)
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    watch.follow(seen.make("a"), "tg.ctl.w1")  # type: ignore[arg-type]
    await settle(lambda: bool(seen.lost))
    # nobody at 0 and 0.2, an answer at 0.4, nobody from 0.6: dead at 1.2
    assert seen.lost == [("a", "tg.ctl.w1", pytest.approx(START + 1.2))]
    watch.close()


async def test_a_timer_a_little_early_still_ends_the_confirmation(
        clock: Clock) -> None:
    """The loop's timers fire up to TIMER_SLACK early against the monotonic
    clock; the probe due at the confirmation's end still ends it."""
    clock.early = 0.004
    nc = ScriptedNats(clock, lambda n: nats.errors.NoRespondersError())
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    watch.follow(seen.make("a"), "tg.ctl.w1")  # type: ignore[arg-type]
    await settle(lambda: bool(seen.lost))
    # the probe due at the end (0.6) woke at 0.596: declared then, not later
    assert seen.lost == [("a", "tg.ctl.w1", pytest.approx(START + 0.596))]
    watch.close()


async def test_a_follower_left_keeps_the_probe_the_last_stops_it(clock: Clock) -> None:
    nc = ScriptedNats(clock, lambda n: timed_out(clock))
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    a, b = seen.make("a"), seen.make("b")
    watch.follow(a, "tg.ctl.w1")  # type: ignore[arg-type]
    watch.follow(b, "tg.ctl.w1")  # type: ignore[arg-type]
    watch.unfollow(a, "tg.ctl.w2")  # type: ignore[arg-type]  # nobody follows w2: nothing
    await settle(lambda: len(nc.requests) >= 3)
    watch.unfollow(a, "tg.ctl.w1")  # type: ignore[arg-type]
    assert watch.following() == ["tg.ctl.w1"]
    probe = watch._probes["tg.ctl.w1"]
    watch.unfollow(b, "tg.ctl.w1")  # type: ignore[arg-type]
    assert watch.following() == []
    await settle(probe.done)
    assert probe.cancelled()
    asked = len(nc.requests)
    await settle(lambda: False, 200)
    assert len(nc.requests) == asked
    assert seen.lost == []


async def test_close_stops_every_probe(clock: Clock) -> None:
    nc = ScriptedNats(clock, lambda n: timed_out(clock))
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    watch.follow(seen.make("a"), "tg.ctl.w1")  # type: ignore[arg-type]
    watch.follow(seen.make("a"), "tg.ctl.w2")  # type: ignore[arg-type]
    probes = list(watch._probes.values())
    assert len(probes) == 2
    watch.close()
    await settle(lambda: all(p.done() for p in probes))
    assert all(p.cancelled() for p in probes)
    assert watch.following() == []


async def test_a_crashed_probe_is_logged_and_an_ended_one_is_not(
        clock: Clock, caplog: pytest.LogCaptureFixture) -> None:
    """A probe that fails is nobody's task unless its failure is logged."""
    caplog.set_level(logging.WARNING, logger="tidegate.liveness")

    def script(n: int) -> Answer:
        subject = nc.requests[n][1]
        if subject == "tg.ctl.crash":
            return RuntimeError("boom")
        return timed_out(clock) if subject == "tg.ctl.left" else nats.errors.NoRespondersError()
    nc = ScriptedNats(clock, script)
    watch = WorkerWatch(nc, 0.2)  # type: ignore[arg-type]
    seen = Followers(clock)
    watch.follow(seen.make("a"), "tg.ctl.crash")  # type: ignore[arg-type]
    crashed = watch._probes["tg.ctl.crash"]
    await settle(crashed.done)
    await _real_sleep(0)  # the done callback runs on the next turn
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == ["worker liveness probe failed"]
    assert errors[0].exc_info
    assert isinstance(errors[0].exc_info[1], RuntimeError)
    caplog.clear()
    watch.follow(seen.make("b"), "tg.ctl.dies")  # type: ignore[arg-type]
    c = seen.make("c")
    watch.follow(c, "tg.ctl.left")  # type: ignore[arg-type]
    left = watch._probes["tg.ctl.left"]
    await settle(lambda: any(name == "b" for name, *_ in seen.lost))
    watch.unfollow(c, "tg.ctl.left")  # type: ignore[arg-type]
    watch.close()
    await settle(left.done)
    await _real_sleep(0)
    assert [r.levelno for r in caplog.records] == [logging.WARNING]  # the death, no error
    assert "tg.ctl.dies" in caplog.records[0].getMessage()

