"""The first burst after a start against a warm one (issue 48's 7.7x).

    python -m bench.first_burst --streams 32 --runs 3 [--set SECTION.KEY=VALUE]

Each run starts a fresh stack (tidegate on its defaults, then the floor,
:mod:`bench.floor`) on one fake backend, sends ``--streams`` streams at once
as soon as the stack has served its one readiness request, waits, and sends
the same burst again. Every deploy, restart and worker scale-out starts at
the first; the second is what a warm gateway gives. Reported: TTFT p50/p99
of each burst (ms) and first / warm p99, per target and run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import loadgen, run_async
from bench.runner import BenchOptions
from bench.targets import MODEL, Target, Targets

TOKENS, ITL, TTFT = 64, 0.010, 0.05  # (a)'s stream shape


async def burst(target: Target, streams: int) -> dict[str, Any]:
    """``streams`` streams sent at once; their TTFT distribution and errors."""
    rec = loadgen.Recorder()
    rec.set_window(time.monotonic() - 1.0, 3600.0)
    body = loadgen.chat_body(MODEL, tokens=TOKENS, itl=ITL, ttft=TTFT)
    async with loadgen.new_session() as session:
        await asyncio.gather(*(loadgen.stream_once(session, target.endpoint, body, rec,
                                                   time.monotonic()) for _ in range(streams)))
    summary = rec.summary()
    return {"ttft_ms": summary["ttft_ms"], "errors": summary["errors"],
            "completed": rec.completed}


async def _twice(target: Target, streams: int,
                 pause: float) -> tuple[dict[str, Any], dict[str, Any]]:
    first = await burst(target, streams)
    await asyncio.sleep(pause)
    return first, await burst(target, streams)


def one_run(streams: int, pause: float, overrides: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("tidegate", "floor"):
        with Targets(Path(tempfile.mkdtemp(prefix="tidegate-first-burst-")),
                     overrides=overrides) as env:
            env.start_fake()
            target = env.start_tidegate() if name == "tidegate" else env.start_floor()

            first, warm = run_async(_twice(target, streams, pause))
        ratio = (round(first["ttft_ms"]["p99"] / warm["ttft_ms"]["p99"], 2)
                 if first["ttft_ms"].get("p99") and warm["ttft_ms"].get("p99") else None)
        out[name] = {"first": first, "warm": warm, "first_over_warm_p99": ratio}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.first_burst",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between the bursts")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = parser.parse_args(argv)
    overrides = dict(BenchOptions.parse_set(args.set))
    runs = []
    for i in range(1, args.runs + 1):
        result = one_run(args.streams, args.pause, overrides)
        runs.append(result)
        for name, r in result.items():
            print(f"run {i} {name:>8}: first p50/p99 {r['first']['ttft_ms'].get('p50')} / "
                  f"{r['first']['ttft_ms'].get('p99')} ms, warm "
                  f"{r['warm']['ttft_ms'].get('p50')} / {r['warm']['ttft_ms'].get('p99')} ms, "
                  f"first/warm p99 {r['first_over_warm_p99']}x, errors "
                  f"{r['first']['errors'] or r['warm']['errors'] or 0}", flush=True)
    for name in ("tidegate", "floor"):
        ratios = [r[name]["first_over_warm_p99"] for r in runs if r[name]["first_over_warm_p99"]]
        if ratios:
            print(f"{name}: first/warm p99 median {statistics.median(ratios):.2f}x "
                  f"over {len(ratios)} runs")
    print(json.dumps({"streams": args.streams, "runs": runs}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
