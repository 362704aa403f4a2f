"""(r) Responses and Anthropic Messages API streaming overhead, next to chat's.

The same closed loop as (a), at the concurrency nearest 200, once with chat
completions and once with the Responses API, on the direct target (the fake
backend) and on tidegate. Both APIs stream the same number of tokens at the
same pace; a Responses stream has 8 more events (created, in_progress, the
item and part openings and closings, completed) and bigger ones (typed JSON
with ids), so its direct floor differs too: each API is compared with its
own direct run. Anthropic's Messages API runs twice on tidegate: passed
through to the fake's own /v1/messages ("messages") and translated to chat
by the worker ("messages-translated", the ``TRANSLATED`` model); both are
compared with the fake's direct /v1/messages. Reported per API: TTFT
overhead over direct (p50/p99), gateway CPU per chunk and per request,
throughput ratio.
"""

from __future__ import annotations

from typing import Any

from bench.overhead_bench import _add_ratios, _load_run
from bench.scenarios import Profile
from bench.targets import Target

__all__ = ["APIS", "responses_overhead"]

APIS = ("chat", "responses", "messages", "messages-translated")


async def responses_overhead(targets: list[Target], profile: Profile) -> dict[str, Any]:
    concurrency = min(profile.concurrencies, key=lambda c: abs(c - 200))
    chosen = [t for t in targets if t.name in ("direct", "tidegate")]
    runs: list[dict[str, Any]] = []
    for api in APIS:
        these = [await _load_run(target, profile, "closed", concurrency, None, api)
                 for target in chosen]
        _add_ratios(these)  # against the direct run of the same API
        runs += these
    summary: dict[str, Any] = {}
    for run in runs:
        if run["target"] != "tidegate":
            continue
        summary[run["api"]] = {
            "ttft_overhead_ms": run.get("ttft_overhead_ms"),
            "cpu_us_per_chunk": run.get("cpu_us_per_chunk"),
            "cpu_ms_per_request": run.get("cpu_ms_per_request"),
            "throughput_ratio": run.get("throughput_ratio"),
            "errors": run.get("error_count"),
        }
    return {"params": {"concurrency": concurrency, "tokens": profile.tokens,
                       "itl_s": profile.itl, "ttft_s": profile.ttft,
                       "warmup_s": profile.warmup, "window_s": profile.duration},
            "runs": runs, "summary": summary}
