"""The numbers behind waiting for a full home (docs/routing.md): what a
worker measures per replica, how it travels in its load messages, and how a
dispatcher's view sums it over the replica's workers. Unit tests; the
decision itself is tests/test_affinity.py, the whole pipeline
tests/test_routing_pipeline.py."""

from __future__ import annotations

import json
import math

import pytest

from dispatcher.routing import ReplicaView
from tidegate import config as tgconfig
from tidegate.control.workers_registry import ReplicaSlot
from workers.routing import ReplicaPullers

CONFIG = tgconfig.from_dict({"models": [{"name": "m", "backend": "openai",
                                         "base_urls": ["http://a:1/v1", "http://b:1/v1"]}]})
MODEL = CONFIG.models[0]
A, B = MODEL.replica_names


def test_a_slot_carries_its_measured_times_and_reads_an_older_one_without() -> None:
    slot = ReplicaSlot(8, 3, service_s=0.25, prefill_s_per_char=1.5e-4, youngest_s=0.1)
    assert ReplicaSlot.decode(json.loads(json.dumps(slot.encode()))) == slot
    # A worker from before the times were measured.
    old = ReplicaSlot.decode({"slots": 8, "in_flight": 3})
    assert (old.service_s, old.prefill_s_per_char, old.youngest_s) == (None, None, None)


@pytest.mark.parametrize("bad", [-1.0, "nan", "inf", "x", [1]])
def test_a_bad_measured_time_drops_the_load_message(bad: object) -> None:
    """A negative time would make every full home worth waiting for: the
    slot is malformed, and the view keeps what it had."""
    with pytest.raises((ValueError, TypeError)):
        ReplicaSlot.decode({"slots": 8, "in_flight": 3, "service_s": bad})
    view = ReplicaView(CONFIG)
    view.on_load(json.dumps({"worker": "w1", "model": "m", "replicas": {
        A: {"slots": 8, "in_flight": 8, "service_s": bad}}}).encode())
    assert view.slots == {}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(group: ReplicaPullers, clock: Clock, seconds: float, ttft: float | None, chars: int,
        *, cold: bool = True) -> None:
    job = f"job-{clock.now}"
    group.started(job)
    clock.now += seconds
    group.observe(job, ttft, chars, cold)


def test_a_worker_measures_service_for_every_job_and_prefill_only_away_from_home(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("workers.routing.time.monotonic", clock)
    group = ReplicaPullers("m", A, 8)
    assert (group.slot().service_s, group.slot().prefill_s_per_char) == (None, None)
    # A job at its home (cached): 10 ms to its first token, the floor.
    run(group, clock, 1.0, 0.01, 3000, cold=False)
    assert group.slot().service_s == pytest.approx(1.0)
    assert group.slot().prefill_s_per_char is None  # no job away from home yet
    # Away from home, 310 ms for 3,000 characters: 100 us a character above the floor.
    # (The floor rises slowly towards slower first tokens: 1 % of the way.)
    run(group, clock, 1.0, 0.31, 3000)
    assert group.slot().prefill_s_per_char == pytest.approx(1e-4, rel=0.02)
    # A job that ended with an error is no sample.
    run(group, clock, 50.0, None, 0)
    assert group.slot().service_s == pytest.approx(1.0)
    # The first 20 jobs: their mean. Then a moving mean, which one long job
    # moves a little, not to it.
    for _ in range(18):
        run(group, clock, 1.0, 0.31, 3000)
    run(group, clock, 21.0, 0.31, 3000)
    assert group.slot().service_s == pytest.approx(2.0)
    run(group, clock, 21.0, 0.31, 3000)
    assert group.slot().service_s == pytest.approx(2.0 + 0.05 * 19)


def test_a_worker_reports_how_long_its_youngest_job_has_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("workers.routing.time.monotonic", clock)
    group = ReplicaPullers("m", A, 8)
    assert group.slot().youngest_s is None
    group.started("old")
    clock.now += 5.0
    group.started("new")
    clock.now += 1.0
    assert group.slot().youngest_s == pytest.approx(1.0)
    group.observe("new", None, 0, cold=True)
    assert group.slot().youngest_s == pytest.approx(6.0)
    group.observe("old", None, 0, cold=True)
    assert group.slot().youngest_s is None


def test_the_view_averages_the_workers_times_and_adds_their_slots() -> None:
    view = ReplicaView(CONFIG)
    view.update("w1", "m", {A: ReplicaSlot(4, 4, service_s=0.2, prefill_s_per_char=1e-4),
                            B: ReplicaSlot(4, 1)})
    view.update("w2", "m", {A: ReplicaSlot(4, 4, service_s=0.4, prefill_s_per_char=3e-4)})
    loads = {load.name: load for load in view.loads(MODEL)}
    assert (loads[A].in_flight, loads[A].limit) == (8, 8)
    assert loads[A].service_s == pytest.approx(0.3)
    assert loads[A].prefill_s_per_char == pytest.approx(2e-4)
    assert loads[A].expected_wait() == pytest.approx(0.3 / 8)
    assert (loads[B].service_s, loads[B].expected_wait()) == (None, None)
    # Jobs routed since the last report wait their turn too.
    view.routed("m", A)
    view.routed("m", A)
    (a,) = [load for load in view.loads(MODEL) if load.name == A]
    assert a.expected_wait() == pytest.approx(3 * 0.3 / 8)


def test_a_home_whose_youngest_job_outlived_a_mean_one_is_not_expected_to_free(
        monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("dispatcher.routing.time.monotonic", clock)
    view = ReplicaView(CONFIG)
    view.update("w1", "m", {A: ReplicaSlot(2, 2, service_s=0.5, prefill_s_per_char=1e-4,
                                           youngest_s=0.2)})
    (a,) = [load for load in view.loads(MODEL) if load.name == A]
    assert a.expected_wait() == pytest.approx(0.25)
    # No report since: the youngest job has run 0.2 + 1 s, twice a mean job.
    clock.now += 1.0
    (a,) = [load for load in view.loads(MODEL) if load.name == A]
    assert a.youngest_s == pytest.approx(1.2)
    assert a.expected_wait() == math.inf
    assert not a.worth_waiting(100_000, 10.0)


def test_a_replica_whose_breaker_is_open_offers_no_slots() -> None:
    """A worker's open breaker takes its replica out of the view: routing
    sends it nothing; half-open, its slots count again (the probe comes by
    routing). tests/test_replica_failover.py counts the jobs at the replica."""
    view = ReplicaView(CONFIG)
    for worker, state in (("w1", "open"), ("w2", "closed")):
        view.on_load(json.dumps({"worker": worker, "model": "m", "replicas": {
            A: {"slots": 8, "in_flight": 0, "breaker": state},
            B: {"slots": 8, "in_flight": 0}}}).encode())
    assert {r.name: r.limit for r in view.loads(MODEL)} == {A: 8, B: 16}
    view.on_load(json.dumps({"worker": "w2", "model": "m", "replicas": {
        A: {"slots": 8, "in_flight": 0, "breaker": "open"}}}).encode())
    assert {r.name: r.limit for r in view.loads(MODEL)}[A] == 0
    view.on_load(json.dumps({"worker": "w2", "model": "m", "replicas": {
        A: {"slots": 8, "in_flight": 0, "breaker": "half_open"}}}).encode())
    assert {r.name: r.limit for r in view.loads(MODEL)}[A] == 8
