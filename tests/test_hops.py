"""bench.hops: a request's time to first token split along its spans, from
spans made by hand, and one traced run of the real stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.hops import HOPS, hop_waits, request_hops
from bench.otlp_sink import ReceivedSpan

MS = 1_000_000


def trace(tid: str, t0: int, *, first: bool = True, retry: bool = False) -> list[ReceivedSpan]:
    """edge 0..100 ms (first token at 90), dispatch 5..7, worker 10..95
    (first token at 80); ``retry``: a later second attempt's span too."""
    def span(service: str, name: str, kind: int, start: int, end: int,
             first_at: int | None) -> ReceivedSpan:
        events = (("gen_ai.first_token", {}),) if first and first_at is not None else ()
        return ReceivedSpan(service, name, tid, f"{start:016x}", "", kind,
                            events=events, start_ns=t0 + start * MS, end_ns=t0 + end * MS,
                            event_ns=tuple(t0 + first_at * MS for _ in events) if first_at
                            else ())
    spans = [span("tidegate-edge", "chat", 2, 0, 100, 90),
             span("tidegate-dispatcher", "dispatch m", 5, 5, 7, None),
             span("tidegate-worker", "chat m", 3, 10, 95, 80)]
    if retry:
        spans.append(span("tidegate-worker", "chat m", 3, 50, 99, 97))
    return spans


def test_one_request_splits_along_its_spans() -> None:
    hops = request_hops(trace("a", 0))
    assert hops == {"edge_to_dispatcher": 5.0, "dispatch": 2.0, "dispatcher_to_worker": 3.0,
                    "worker_to_first_token": 70.0, "first_token_to_edge": 10.0, "total": 90.0}
    assert sum(v for k, v in hops.items() if k != "total") == hops["total"]
    assert request_hops(trace("b", 0, retry=True)) == hops, "the first attempt's job span"
    assert request_hops(trace("c", 0, first=False)) is None, "no first token: left out"
    assert request_hops(trace("d", 0)[:2]) is None, "no worker span: left out"


def test_waits_over_many_requests_skip_the_warmup() -> None:
    spans = [s for i in range(10) for s in trace(f"t{i}", i * 1000 * MS)]
    spans += trace("broken", 0, first=False)
    out = hop_waits(spans, skip_s=2.5)
    assert (out["traces"], out["requests"]) == (11, 7)  # t3..t9
    assert out["hops"]["total"] == {"p50": 90.0, "p99": 90.0, "mean": 90.0}
    assert list(out["hops"]) == list(HOPS)
    assert hop_waits([]) == {"requests": 0, "traces": 0, "hops": {}}


@pytest.mark.pipeline
def test_a_traced_run_of_the_real_stack_splits_its_first_tokens() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEGATE_", "OTEL_"))}
    done = subprocess.run([sys.executable, "-m", "bench.hops", "--concurrency", "4",
                           "--window", "2", "--warmup", "1", "--sample", "1", "--json"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["requests"] > 0, result
    assert list(result["hops"]) == list(HOPS), result
    hops = {k: v["mean"] for k, v in result["hops"].items()}
    # The backend's own TTFT lies inside the worker's hop, and the hops add
    # up to the whole (each mean over the same requests).
    assert hops["worker_to_first_token"] >= result["ttft_ms"] * 0.9, result
    assert sum(v for k, v in hops.items() if k != "total") == pytest.approx(
        hops["total"], abs=0.1), result
    assert set(result["runqueue_wait_s"]) >= {"edge", "dispatcher", "worker"}, result
