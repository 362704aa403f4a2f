"""An interactive burst on a backend that lower classes fill (issue 49 item 4).

    python -m bench.preemption_bench [--slots 32] [--burst 64] [--fill 32] [--tiers]

The fake backend is deterministic (greedy text) and slows past ``--slots``
streams; tidegate's model is pinned to ``--slots``. Per run, three fresh stacks:
``idle`` (the burst alone), ``on`` (shipped preemption), ``off``
(``preempt_after = 0`` whatever ``--set`` says). The fill (a batch's lines, then
background responses; with ``--tiers``, an untiered tenant's streams, the burst
a weight-4 tenant's) takes every slot, then ``--burst`` interactive streams.
Reported: the burst's TTFT p50/p99 and errors, each fill answer against the
greedy text (as its client read it), the worker's preemptions, and the useful
throughput (output tokens of every answer per second, fill to last answer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from bench import loadgen, run_async
from bench.runner import BenchOptions
from bench.targets import MODEL, Target, Targets
from tidegate import config as tgconfig
from tidegate.apis.responses import DIALECT as RESPONSES
from tidegate.broker import broker
from tidegate.control.keys import create_key, ensure_keys_bucket
from workers.backends.greedy import greedy_plan

BURST_TOKENS, ITL, TTFT = 64, 0.010, 0.05  # (a)'s stream shape
VARIANTS = ("idle", "on", "off")
TIERS = [{"name": "gold", "weight": 4, "tenants": ["gold-tenant"]}]
PREEMPT_AFTER = "models.queue.preempt_after"


def expected(body: dict[str, Any]) -> str:
    """The fake's uninterrupted answer to a fill request (chat or Responses)."""
    chat = RESPONSES.chat_body(body) if "input" in body else body
    limit = body.get("max_output_tokens") or body.get("max_tokens")
    return "".join(greedy_plan(True, chat or {}, limit, 1_000_000))


async def _json(session: aiohttp.ClientSession, method: str, url: str,
                headers: dict[str, str], **kwargs: Any) -> Any:
    async with session.request(method, url, headers=headers, **kwargs) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise RuntimeError(f"{method} {url}: {resp.status} {text[:300]}")
        return json.loads(text)


async def _fill(session: aiohttp.ClientSession, env: Targets, target: Target, n: int,
                tokens: int) -> tuple[list[tuple[str, dict[str, Any]]], str, dict[str, Any]]:
    """A batch of ``n - n // 2`` lines, then ``n // 2`` background responses;
    their ids and bodies. The batch comes first: with interactive work running
    (a background response is interactive to the batch runner) batch lines
    take only a share of the free slots (``batch.share_under_load``)."""
    base, headers = target.endpoint.base_url, dict(target.endpoint.headers)
    lines = {f"line-{i}": {"model": MODEL, "max_tokens": tokens,
                           "messages": [{"role": "user", "content": f"batch fill {i}"}]}
             for i in range(n - n // 2)}
    data = b"".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                "body": body}).encode() + b"\n" for cid, body in lines.items())
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", data, filename="fill.jsonl", content_type="application/jsonl")
    file = await _json(session, "POST", f"{base}/files", headers, data=form)
    batch = await _json(session, "POST", f"{base}/batches", headers, json={
        "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
        "completion_window": "24h"})
    await _all_slots_taken(env, len(lines))
    responses = []
    for i in range(n // 2):
        body = {"model": MODEL, "input": f"background fill {i}", "background": True,
                "max_output_tokens": tokens}
        answer = await _json(session, "POST", f"{base}/responses", headers, json=body)
        responses.append((answer["id"], body))
    return responses, batch["id"], lines


async def _settled(session: aiohttp.ClientSession, target: Target,
                   responses: list[tuple[str, dict[str, Any]]], batch_id: str,
                   lines: dict[str, Any], within: float = 900.0) -> dict[str, Any]:
    """Every fill answer, once all ended: exact against the greedy text or not."""
    base, headers = target.endpoint.base_url, dict(target.endpoint.headers)
    deadline = time.monotonic() + within
    answers: dict[str, tuple[str, int]] = {}
    while time.monotonic() < deadline:
        for rid, _ in responses:
            if rid not in answers:
                r = await _json(session, "GET", f"{base}/responses/{rid}", headers)
                if r["status"] not in ("queued", "in_progress"):
                    text = "".join(c.get("text", "") for item in r.get("output", [])
                                   for c in item.get("content", []) or [])
                    answers[rid] = (text, (r.get("usage") or {}).get("output_tokens", 0))
        batch = await _json(session, "GET", f"{base}/batches/{batch_id}", headers)
        if len(answers) == len(responses) and batch["status"] in ("completed", "failed",
                                                                    "expired", "cancelled"):
            break
        await asyncio.sleep(0.5)
    else:
        raise RuntimeError(f"the fill did not end within {within:g}s")
    exact = sum(answers[rid][0] == expected(body) for rid, body in responses)
    tokens = sum(t for _, t in answers.values())
    if batch.get("output_file_id"):
        async with session.get(f"{base}/files/{batch['output_file_id']}/content",
                               headers=headers) as resp:
            out = [json.loads(line) for line in (await resp.read()).splitlines() if line]
        for line in out:
            answer = line["response"]["body"]
            exact += answer["choices"][0]["message"]["content"] == expected(
                lines[line["custom_id"]])
            tokens += answer["usage"]["completion_tokens"]
    return {"exact": exact, "of": len(responses) + len(lines), "output_tokens": tokens,
            "batch": batch["status"]}


async def _all_slots_taken(env: Targets, slots: int, within: float = 120.0) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        running = [r for r in env.records() if r["finished_at"] is None]
        if len(running) >= slots:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"the fill did not take {slots} slots within {within:g}s")


# A fill: given the session, it starts the lower-priority work and returns
# what ends it (an awaitable of its report: exact, of, output_tokens).
Fill = Callable[[aiohttp.ClientSession], Awaitable[Awaitable[dict[str, Any]]]]


async def _variant(env: Targets, endpoint: loadgen.Endpoint, name: str,
                   args: argparse.Namespace, fill: Fill) -> dict[str, Any]:
    """The fill (not when ``idle``), once it holds every slot the burst on
    ``endpoint``, then the fill's end."""
    rec = loadgen.Recorder()
    body = loadgen.chat_body(MODEL, tokens=BURST_TOKENS, itl=ITL, ttft=TTFT)
    async with loadgen.new_session() as session:
        start = time.monotonic()
        settle = None
        if name != "idle":
            settle = await fill(session)
            await _all_slots_taken(env, args.slots)
        rec.set_window(time.monotonic() - 1.0, 3600.0)
        await asyncio.gather(*(loadgen.stream_once(session, endpoint, body, rec,
                                                   time.monotonic())
                               for _ in range(args.burst)))
        filled = await settle if settle is not None else {}
        elapsed = time.monotonic() - start
    summary = rec.summary()
    useful = filled.get("output_tokens", 0) + rec.completed * BURST_TOKENS
    log = (env.logs / "worker.log").read_text(errors="replace")
    return {"ttft_ms": summary["ttft_ms"], "errors": summary["errors"],
            "completed": rec.completed, "fill": filled,
            "preempted": log.count("its slot goes to an interactive request"),
            "useful_tokens_per_s": round(useful / elapsed, 1), "elapsed_s": round(elapsed, 1)}


def _mixed_fill(env: Targets, target: Target, args: argparse.Namespace) -> Fill:
    async def start(session: aiohttp.ClientSession) -> Awaitable[dict[str, Any]]:
        responses, batch_id, lines = await _fill(session, env, target, args.fill,
                                                 args.fill_tokens)
        return _settled(session, target, responses, batch_id, lines)
    return start


async def _gold_key(env: Targets) -> str:
    """A key of the gold tier's tenant, made as an admin would."""
    config = tgconfig.load(env.workdir / "tidegate.toml")
    nc = await broker.connect(config.nats, "tidegate-bench-admin")
    try:
        kv = await ensure_keys_bucket(broker.jetstream(nc, config.nats), config)
        return (await create_key(kv, "gold-tenant"))[0]
    finally:
        await nc.close()


async def _light_stream(session: aiohttp.ClientSession, target: Target,
                        body: dict[str, Any]) -> tuple[bool, int]:
    """One untiered fill stream read to its end: (its text exact, its output tokens)."""
    text, tokens = [], 0
    async with session.post(target.endpoint.chat_url, headers=dict(target.endpoint.headers),
                            json={**body, "stream_options": {"include_usage": True}}) as resp:
        if resp.status != 200:
            return False, 0
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                text += [c["delta"].get("content") or "" for c in event["choices"]]
                tokens = (event.get("usage") or {}).get("completion_tokens", tokens)
    return "".join(text) == expected(body), tokens


def _light_fill(target: Target, args: argparse.Namespace) -> Fill:
    async def start(session: aiohttp.ClientSession) -> Awaitable[dict[str, Any]]:
        streams = [asyncio.create_task(_light_stream(session, target, {
            "model": MODEL, "stream": True, "max_tokens": args.fill_tokens,
            "messages": [{"role": "user", "content": f"light fill {i}"}]}))
            for i in range(args.fill)]

        async def settle() -> dict[str, Any]:
            answers = await asyncio.gather(*streams)
            return {"exact": sum(ok for ok, _ in answers), "of": len(answers),
                    "output_tokens": sum(t for _, t in answers)}
        return settle()
    return start


async def _one(env: Targets, target: Target, name: str,
               args: argparse.Namespace) -> dict[str, Any]:
    if not args.tiers:
        return await _variant(env, target.endpoint, name, args, _mixed_fill(env, target, args))
    gold = loadgen.Endpoint("gold", target.endpoint.base_url, MODEL,
                            {"Authorization": f"Bearer {await _gold_key(env)}"})
    return await _variant(env, gold, name, args, _light_fill(target, args))


def one_run(args: argparse.Namespace, overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in VARIANTS:
        settings: dict[str, Any] = {"tiers": TIERS} if args.tiers else {}
        mine = dict(overrides)
        if name == "off":  # off whatever --set says
            settings[PREEMPT_AFTER] = 0.0
            mine.pop(PREEMPT_AFTER, None)
        with Targets(Path(tempfile.mkdtemp(prefix="tidegate-preemption-")),
                     overrides=mine) as env:
            env.start_fake("--deterministic", "--saturate-at", str(args.slots))
            target = env.start_tidegate(max_streams=args.slots, settings=settings)
            out[name] = run_async(_one(env, target, name, args))
        r = out[name]
        print(f"{name:>4}: TTFT p50/p99 {r['ttft_ms'].get('p50')} / {r['ttft_ms'].get('p99')} ms, "
              f"errors {r['errors'] or 0}, fill exact {r['fill'].get('exact', '-')} of "
              f"{r['fill'].get('of', '-')}, preempted {r['preempted']}, useful "
              f"{r['useful_tokens_per_s']} tokens/s", flush=True)
    idle = out["idle"]["ttft_ms"]
    for name in ("on", "off"):
        got = out[name]["ttft_ms"]
        out[name]["over_idle"] = {q: round(got[q] / idle[q], 2) for q in ("p50", "p99")
                                  if got.get(q) and idle.get(q)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.preemption_bench",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--burst", type=int, default=64)
    parser.add_argument("--fill", type=int, default=32, help="background responses + lines")
    parser.add_argument("--fill-tokens", type=int, default=1500)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--tiers", action="store_true",
                        help="the fill an untiered tenant's streams, the burst a gold tenant's")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    overrides = dict(BenchOptions.parse_set(args.set))
    runs = []
    for i in range(1, args.runs + 1):
        print(f"run {i}", flush=True)
        runs.append(one_run(args, overrides))
        for name in ("on", "off"):
            print(f"  {name} over idle: {runs[-1][name]['over_idle']}", flush=True)
    print(json.dumps({"args": vars(args), "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
