"""Scenario (c) of ``tidegate bench``, cancel latency: clients close mid-stream;
the time from the client's close to the fake backend seeing its connection close."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from bench import loadgen
from bench.loadgen import Recorder, chat_body, distribution, new_session
from bench.scenarios import Profile, _bench_id, _cdf
from bench.targets import Target, Targets


async def _cancel_run(env: Targets, target: Target, profile: Profile, *,
                      explicit: bool = False) -> dict[str, Any]:
    """(c) on one target: clients hang up after a few chunks (``explicit``:
    they ``POST /v1/streams/{id}/cancel`` instead and read on); latency from
    the hang-up (the POST's send) to the fake backend seeing its connection
    closed."""
    endpoint = target.endpoint
    since = env.last_record_id()
    closes: dict[str, float] = {}
    rec = Recorder()
    rec.set_window(0.0, float("inf"))  # every stream is a sample

    async def user(session: Any, i: int) -> None:
        # Spread over one stream's lifetime, so the cancels do not all land
        # in the same millisecond (which would measure the burst, not the path).
        await asyncio.sleep(i / profile.cancel_concurrency * profile.cancel_tokens
                            * profile.itl / 2)
        for _ in range(profile.cancel_rounds):
            bench_id = _bench_id(f"cancel-{target.name}")
            body = chat_body(endpoint.model, tokens=profile.cancel_tokens, itl=profile.itl,
                             ttft=profile.ttft, bench_id=bench_id)
            closed = await loadgen.stream_once(session, endpoint, body, rec, time.monotonic(),
                                               cancel_after=profile.cancel_after,
                                               explicit_cancel=explicit)
            if closed is not None:
                closes[bench_id] = closed

    async with new_session() as session, asyncio.TaskGroup() as tg:
        for i in range(profile.cancel_concurrency):
            tg.create_task(user(session, i))
    # The slowest possible propagation we still want to see: one heartbeat.
    await asyncio.sleep(max(1.0, profile.heartbeat_interval))
    seen = {r["bench_id"]: r for r in env.records(since) if r["bench_id"] in closes}
    latencies: list[float] = []
    outcome = {"closed": 0, "completed_anyway": 0, "still_open": 0, "no_record": 0}
    for bench_id, closed_at in closes.items():
        record = seen.get(bench_id)
        if record is None:
            outcome["no_record"] += 1
        elif record["closed_at"] is not None:
            outcome["closed"] += 1
            latencies.append(record["closed_at"] - closed_at)
        elif record["completed"]:
            outcome["completed_anyway"] += 1
        else:
            outcome["still_open"] += 1
    return {"target": target.name, "cancels": len(closes), "outcomes": outcome,
            "stream_errors": dict(rec.errors), "latency_ms": distribution(latencies),
            "latency_cdf_ms": _cdf(latencies)}


async def cancel(env: Targets, targets: list[Target], profile: Profile) -> dict[str, Any]:
    runs = [await _cancel_run(env, t, profile) for t in targets]
    return {"params": {"concurrency": profile.cancel_concurrency,
                       "rounds": profile.cancel_rounds, "cancel_after_chunks":
                       profile.cancel_after, "tokens": profile.cancel_tokens},
            "runs": runs}
