"""(j) batch: the batch API's two targets (issue 13, docs/batch.md).

1. **Throughput.** The same lines, once as interactive non-streaming requests
   (closed loop at the batch's own concurrency bound, ``batch.max_running``)
   and once as a batch (upload, create, poll until ``completed``): lines per
   second of each, and their ratio (target >= 0.9).
2. **Interactive first.** The interactive TTFT p99 at ``streams`` concurrent
   streams, alone and with a batch of ``lines`` lines running (target: within
   10 % or 20 ms, whichever is larger).

Only on the tidegate target; ``--quick`` runs tiny sizes to prove it works.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from bench.loadgen import new_session
from bench.targets import Target

QUICK = {"lines": 40, "streams": 5, "concurrency": 16}
FULL = {"lines": 2000, "streams": 50, "concurrency": 512}


def _line(i: int, model: str, tokens: int, itl: float, ttft: float) -> dict[str, Any]:
    return {"custom_id": f"x-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "max_tokens": tokens, "fake_itl": itl, "fake_ttft": ttft,
                     "messages": [{"role": "user", "content": f"Batch benchmark {i}."}]}}


async def _interactive(session: aiohttp.ClientSession, target: Target,
                       lines: list[dict[str, Any]], concurrency: int) -> float:
    """Seconds to run ``lines`` as plain requests, ``concurrency`` at a time."""
    gate = asyncio.Semaphore(concurrency)
    url, headers = target.endpoint.chat_url, dict(target.endpoint.headers)

    async def one(line: dict[str, Any]) -> None:
        async with gate, session.post(url, json=line["body"], headers=headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"interactive request failed: {resp.status}")

    start = time.monotonic()
    await asyncio.gather(*(one(line) for line in lines))
    return time.monotonic() - start


async def _submit(session: aiohttp.ClientSession, target: Target,
                  lines: list[dict[str, Any]]) -> str:
    base, headers = target.endpoint.base_url, dict(target.endpoint.headers)
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="bench.jsonl")
    async with session.post(f"{base}/files", data=form, headers=headers) as resp:
        file = await resp.json()
    async with session.post(f"{base}/batches", headers=headers, json={
            "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
            "completion_window": "24h"}) as resp:
        return str((await resp.json())["id"])


async def _status(session: aiohttp.ClientSession, target: Target, batch_id: str) -> Any:
    async with session.get(f"{target.endpoint.base_url}/batches/{batch_id}",
                           headers=dict(target.endpoint.headers)) as resp:
        return await resp.json()


async def _until(session: aiohttp.ClientSession, target: Target, batch_id: str,
                 statuses: set[str], within: float) -> Any:
    deadline = time.monotonic() + within
    while True:
        batch = await _status(session, target, batch_id)
        if batch["status"] in statuses or time.monotonic() > deadline:
            return batch
        await asyncio.sleep(0.1)


async def _ttft_p99(target: Target, profile: Any, streams: int) -> float | None:
    from bench.overhead_bench import _load_run

    run = await _load_run(target, profile, "closed", streams, None)
    p99 = run["ttft_ms"].get("p99")
    return None if p99 is None else float(p99)


async def run(targets: list[Target], profile: Any, quick: bool) -> dict[str, Any]:
    target = next((t for t in targets if t.name == "tidegate"), None)
    if target is None:
        return {"skipped": "needs the tidegate target"}
    size = QUICK if quick else FULL
    model = target.endpoint.model
    lines = [_line(i, model, profile.tokens, profile.itl, profile.ttft)
             for i in range(size["lines"])]
    out: dict[str, Any] = {"params": {**size, "tokens": profile.tokens, "itl_s": profile.itl}}
    async with new_session() as session:
        seconds = await _interactive(session, target, lines, size["concurrency"])
        start = time.monotonic()
        batch_id = await _submit(session, target, lines)
        done = await _until(session, target, batch_id, {"completed", "failed", "expired"},
                            within=600)
        batch_seconds = time.monotonic() - start
        interactive_rate = len(lines) / seconds
        batch_rate = len(lines) / batch_seconds
        out["throughput"] = {
            "interactive_lines_per_s": round(interactive_rate, 1),
            "batch_lines_per_s": round(batch_rate, 1), "batch_status": done["status"],
            "ratio": round(batch_rate / interactive_rate, 3), "target_ratio": 0.9}

        alone = await _ttft_p99(target, profile, size["streams"])
        batch_id = await _submit(session, target, lines)
        await _until(session, target, batch_id, {"in_progress"}, within=60)
        with_batch = await _ttft_p99(target, profile, size["streams"])
        during = await _status(session, target, batch_id)
        async with session.post(f"{target.endpoint.base_url}/batches/{batch_id}/cancel",
                                headers=dict(target.endpoint.headers)) as resp:
            await resp.read()
        await _until(session, target, batch_id, {"cancelled", "completed"}, within=60)
    allowed = None if alone is None else max(alone * 1.1, alone + 20.0)
    out["priority"] = {
        "ttft_p99_ms_alone": alone, "ttft_p99_ms_with_batch": with_batch,
        "allowed_ms": None if allowed is None else round(allowed, 3),
        "batch_lines_done_meanwhile": (during.get("request_counts") or {}).get("completed"),
        "within_target": None if allowed is None or with_batch is None
        else with_batch <= allowed}
    return out


def markdown(x: dict[str, Any]) -> list[str]:
    if "skipped" in x:
        return [f"## (j) batch\n\nskipped: {x['skipped']}\n"]
    t, p = x["throughput"], x["priority"]
    return ["## (j) batch", "",
            f"{x['params']['lines']} lines; interactive {t['interactive_lines_per_s']} lines/s, "
            f"batch {t['batch_lines_per_s']} lines/s: ratio {t['ratio']} (target >= 0.9).",
            "",
            f"Interactive TTFT p99 at {x['params']['streams']} streams: "
            f"{p['ttft_p99_ms_alone']} ms alone, {p['ttft_p99_ms_with_batch']} ms with a "
            f"batch running (allowed {p['allowed_ms']} ms; within: {p['within_target']}).", ""]
