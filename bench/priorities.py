"""Process priorities against a stream's first-token waits.

    python -m bench.priorities --concurrency 50,200 --runs 3

(a)'s closed loop on tidegate's defaults, a fresh stack per run, three variants
in turn: ``plain`` (inherited nice values), ``broker-first`` (nats-server at
nice -5; needs CAP_SYS_NICE, skipped without) and ``tiers-last`` (the Python
tiers at nice +5). Each run reports TTFT p50/p99, streams per second, CPU per
chunk and each process's run-queue wait; the direct run per concurrency gives
the overhead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

VARIANTS = ("plain", "broker-first", "tiers-last")
TIERS = ("edge", "dispatcher", "worker")


def _renice(pid: int, value: int) -> None:
    """Every thread of ``pid`` (Linux's nice is per thread)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.setpriority(os.PRIO_PROCESS, int(task), value)


def _can_raise() -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0))
        return os.geteuid() == 0
    except OSError:
        return False


def _one(variant: str, concurrency: int, window: float) -> dict[str, Any]:
    from bench import overhead_bench, run_async, scenarios
    from bench.targets import Targets

    profile = dataclasses.replace(scenarios.FULL, concurrencies=(concurrency,),
                                  duration=window)
    with Targets(Path(tempfile.mkdtemp(prefix="tidegate-priorities-"))) as env:
        direct = env.start_fake()
        target = env.start_tidegate()
        if variant == "broker-first":
            pid = target.cpu["nats-server"].pid
            assert pid is not None
            _renice(pid, -5)
        elif variant == "tiers-last":
            for tier in TIERS:
                pid = target.cpu[tier].pid
                assert pid is not None
                _renice(pid, 5)
        run = run_async(overhead_bench._load_run(target, profile, "closed", concurrency, None))
        base = run_async(overhead_bench._load_run(direct, profile, "closed", concurrency, None))
    return {"variant": variant, "concurrency": concurrency,
            "ttft_p50_ms": run["ttft_ms"]["p50"], "ttft_p99_ms": run["ttft_ms"]["p99"],
            "direct_ttft_p50_ms": base["ttft_ms"]["p50"],
            "direct_ttft_p99_ms": base["ttft_ms"]["p99"],
            "streams_per_s": run["streams_per_s"], "direct_streams_per_s": base["streams_per_s"],
            "cpu_us_per_chunk": run.get("cpu_us_per_chunk"),
            "runqueue_wait_s": run.get("runqueue_wait_s"), "errors": run.get("error_count")}


def _table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| streams | variant | runs | TTFT overhead p50 | TTFT overhead p99 | share of "
             "direct | CPU per chunk |", "| --- | --- | --- | --- | --- | --- | --- |"]
    keys = sorted({(r["concurrency"], r["variant"]) for r in runs},
                  key=lambda k: (k[0], VARIANTS.index(k[1])))
    for concurrency, variant in keys:
        rs = [r for r in runs if (r["concurrency"], r["variant"]) == (concurrency, variant)]

        def med(f: Any, rs: list[dict[str, Any]] = rs) -> float:
            return float(statistics.median(f(r) for r in rs))

        lines.append(
            f"| {concurrency} | {variant} | {len(rs)} "
            f"| {med(lambda r: r['ttft_p50_ms'] - r['direct_ttft_p50_ms']):.1f} ms "
            f"| {med(lambda r: r['ttft_p99_ms'] - r['direct_ttft_p99_ms']):.1f} ms "
            f"| {med(lambda r: r['streams_per_s'] / r['direct_streams_per_s']):.3f} "
            f"| {med(lambda r: r['cpu_us_per_chunk'] or 0):.1f} us |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="50,200")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--window", type=float, default=8.0)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path, help="write every run's JSON here")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if "broker-first" in variants and not _can_raise():
        print("broker-first skipped: raising a priority needs root or CAP_SYS_NICE",
              file=sys.stderr)
        variants.remove("broker-first")
    runs = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        for i in range(args.runs):
            for variant in variants:
                run = _one(variant, concurrency, args.window)
                runs.append(run)
                print(f"{concurrency} streams, run {i + 1}, {variant}: "
                      f"TTFT {run['ttft_p50_ms']:.1f} / {run['ttft_p99_ms']:.1f} ms "
                      f"(direct {run['direct_ttft_p50_ms']:.1f} / "
                      f"{run['direct_ttft_p99_ms']:.1f}), {run['streams_per_s']} streams/s "
                      f"(direct {run['direct_streams_per_s']}), {run['cpu_us_per_chunk']} us "
                      f"per chunk, run queue {run['runqueue_wait_s']}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(runs, indent=1))
    print("\n".join(_table(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
