"""Scenario (s) of ``tidegate bench``: what resumable streams cost.

Two tidegate stacks side by side, both on the default config, the second with
``resumable = true`` on the bench's model (every stream logged to
``TG_STREAMLOG``, every SSE event carrying ``id:``, docs/resume.md):

* load: (a)'s closed loop at 200 streams, spread and burst, on direct, the
  default stack and the resumable one in turn: CPU per relayed chunk (every
  tidegate process and nats-server, which now also stores the log), TTFT
  overhead and throughput against direct in the same run;
* cancel: (c) on the resumable stack with the explicit cancel,
  ``POST /v1/streams/{id}/cancel`` after a few chunks while the client keeps
  reading; latency from the POST's send to the fake backend seeing its
  connection closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from bench import cancel_bench, overhead_bench, scenarios
from bench.targets import Target, Targets

__all__ = ["markdown", "run"]

CONCURRENCY = 200


async def run(env: Targets, targets: list[Target], profile: scenarios.Profile) -> dict[str, Any]:
    by_name = {t.name: t for t in targets}
    direct, default = by_name["direct"], by_name["tidegate"]
    resumable = await asyncio.to_thread(env.start_tidegate, "resumable",
                                        settings={"models.resumable": True})
    try:
        c = CONCURRENCY if profile.name == "full" else max(profile.concurrencies)
        runs: list[dict[str, Any]] = []
        for arrival in profile.arrivals:
            for target in (direct, default, resumable):
                runs.append(await overhead_bench._load_run(target, profile, "closed", c, None,
                                                           arrival=arrival))
        overhead_bench._add_ratios(runs)
        cancel_profile = dataclasses.replace(profile, cancel_rounds=1)
        cancel = await cancel_bench._cancel_run(env, resumable, cancel_profile, explicit=True)
    finally:
        await asyncio.to_thread(env.stop_stack, "resumable")
    return {"params": {"concurrency": c, "arrivals": list(profile.arrivals),
                       "tokens": profile.tokens, "cancel_concurrency":
                       profile.cancel_concurrency, "cancel_after_chunks": profile.cancel_after},
            "runs": runs, "cancel": cancel}


def markdown(s: dict[str, Any]) -> list[str]:
    p = s["params"]
    out = ["## (s) Resumable streams", "",
           f"(a)'s closed loop at {p['concurrency']} streams of {p['tokens']} tokens on the "
           "default stack and on a second one with `resumable = true` (same config "
           "otherwise). CPU/chunk sums every tidegate process and nats-server.", "",
           "| target | arrival | streams/s | throughput vs direct | TTFT overhead p50 / p99 ms "
           "| CPU µs/chunk | errors |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in s["runs"]:
        over = r.get("ttft_overhead_ms") or {}
        out.append(f"| {r['target']} | {r.get('arrival', '-')} | {r['streams_per_s']} | "
                   f"{r.get('throughput_ratio', '-')} | {over.get('p50', '-')} / "
                   f"{over.get('p99', '-')} | {r.get('cpu_us_per_chunk', '-')} | "
                   f"{r['error_count']} |")
    cancel = s["cancel"]
    lat = cancel["latency_ms"]
    out += ["", f"Explicit cancel (`POST /v1/streams/{{id}}/cancel`, {p['cancel_concurrency']} "
            f"streams at once, after {p['cancel_after_chunks']} chunks): {cancel['cancels']} "
            f"sent, outcomes {cancel['outcomes']}; latency to the backend's close p50 / p99 / "
            f"max {lat.get('p50', '-')} / {lat.get('p99', '-')} / {lat.get('max', '-')} ms.", ""]
    return out
