"""Alternating A/B runs of (a)'s closed loop: which of two trees or settings
costs less CPU per chunk, on a machine whose speed drifts by minutes.

    python -m bench.alternate --rounds 3 base=tree:/tmp/base work=tree:.

A variant is ``NAME=tree:PATH`` (a checkout, first on ``PYTHONPATH``, its
processes run in that folder), ``NAME=env:KEY=VALUE[,...]``,
``NAME=set:SECTION.KEY=VALUE[,...]`` (as ``tidegate bench --set``) or
``NAME=proxy`` (the plain proxy of scenario e) or ``NAME=floor`` (:mod:`bench.floor`,
the design's floor). A round runs every variant
once, each on a fresh stack, in the given order on odd rounds and reversed on
even ones; only a difference that holds in every round means something.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.runner import BenchOptions
from tidegate.errors import TidegateError

if TYPE_CHECKING:
    from bench.targets import Target

__all__ = ["PEERS", "Variant", "parse_variant", "summary_line"]

PEERS = ("proxy", "floor")  # NAME=proxy, NAME=floor: another target than tidegate


@dataclasses.dataclass(frozen=True, slots=True)
class Variant:
    name: str
    env: dict[str, str]
    settings: tuple[str, ...] = ()  # SECTION.KEY=VALUE, for the child's --set
    peer: str = ""  # "proxy" or "floor" instead of tidegate
    cwd: Path | None = None  # a tree's root: where its processes run (see the module docstring)

    def environ(self) -> dict[str, str]:
        env = {**os.environ, **self.env}
        if "PYTHONPATH" in self.env and os.environ.get("PYTHONPATH"):
            env["PYTHONPATH"] = f"{self.env['PYTHONPATH']}{os.pathsep}{os.environ['PYTHONPATH']}"
        return env


def parse_variant(text: str) -> Variant:
    """``base=tree:/src``, ``one=env:GOMAXPROCS=1,X=2``,
    ``wide=set:dispatcher.batch=256``, ``plain=proxy`` or ``min=floor``;
    TidegateError if not."""
    name, sep, spec = text.partition("=")
    if sep and name and spec in PEERS:
        return Variant(name, {}, peer=spec)
    kind, _, value = spec.partition(":")
    if not sep or not name or not value or kind not in ("tree", "env", "set"):
        raise TidegateError(f"a variant is NAME=tree:PATH, NAME=env:KEY=VALUE[,...], "
                            f"NAME=set:SECTION.KEY=VALUE[,...], NAME=proxy or NAME=floor, "
                            f"not {text!r}")
    if kind == "tree":
        root = Path(value).resolve()
        if not (root / "tidegate" / "__init__.py").is_file():
            raise TidegateError(f"{value!r} is not a tidegate source tree "
                                "(no tidegate/__init__.py)")
        return Variant(name, {"PYTHONPATH": str(root)}, cwd=root)
    pairs = [item.partition("=") for item in value.split(",")]
    if any(not key or not eq for key, eq, _ in pairs):
        raise TidegateError(f"{kind} variant {name!r} takes KEY=VALUE pairs, not {value!r}")
    if kind == "set":
        settings = tuple(value.split(","))
        BenchOptions.parse_set(list(settings))  # the same rules as tidegate bench --set
        return Variant(name, {}, settings)
    return Variant(name, {key: val for key, _, val in pairs})


def summary_line(name: str, result: dict[str, Any]) -> str:
    cpu = result["cpu_s"]
    by_tier = " ".join(f"{k} {v:.2f}" for k, v in cpu.items() if v is not None)
    itl = result.get("itl_ms") or [0.0, 0.0]
    return (f"{name:>10}  {result['us_per_chunk']:6.1f} us/chunk  ({by_tier} s)  "
            f"TTFT overhead p50 {result['ttft_overhead_ms'][0]:.1f} / "
            f"p99 {result['ttft_overhead_ms'][1]:.1f} ms  ITL p50 {itl[0]:.1f} / "
            f"p99 {itl[1]:.1f} ms  vs direct {result['ratio']:.3f}")


async def _served(target: Target, profile: Any, within: float = 120.0) -> None:
    """Until one stream went through ``target``: a fresh stack's first one
    waits for JetStream's stream leaders (seconds on a busy machine), which
    the warm-up must not be left to cover, or a short window sees nothing.
    It is a stream of the load's own shape: a shorter or faster one gives
    the adaptive limit a baseline the load then misses by its own pace, and
    it leaves slow start at once (seen: a 2-token stream at 1 ms a token
    made the first window of 10 ms tokens look 4x congested)."""
    from bench.loadgen import Recorder, chat_body, new_session, stream_once

    endpoint = target.endpoint
    deadline = time.monotonic() + within
    async with new_session(timeout=within) as session:
        while True:
            rec = Recorder()
            await stream_once(session, endpoint, chat_body(
                endpoint.model, tokens=profile.tokens, itl=profile.itl, ttft=profile.ttft),
                rec, 0.0)
            if rec.completed:
                return
            if time.monotonic() > deadline:
                raise TidegateError(f"no stream through {target.name} within {within:g}s: "
                                    f"{dict(rec.errors)}")
            await asyncio.sleep(0.2)


def _one(concurrency: int, window: float, warmup: float,
         overrides: dict[str, Any], peer: str = "") -> dict[str, Any]:
    """One direct run and one tidegate (or ``peer``) run on fresh stacks
    (this process's tree)."""
    from bench import overhead_bench, run_async, scenarios
    from bench.targets import Targets

    profile = dataclasses.replace(scenarios.FULL, concurrencies=(concurrency,),
                                  duration=window, warmup=warmup)
    # tidegate's defaults, as in `tidegate bench` (a): pin with set:models.max_streams=N.
    with Targets(Path(tempfile.mkdtemp(prefix="tidegate-alternate-")),
                 overrides=overrides) as env:
        fake = env.start_fake()
        tidegate = {"proxy": env.start_proxy, "floor": env.start_floor}.get(
            peer, env.start_tidegate)()

        async def both() -> tuple[dict[str, Any], dict[str, Any]]:
            await _served(tidegate, profile)
            direct = await overhead_bench._load_run(fake, profile, "closed", concurrency, None)
            ours = await overhead_bench._load_run(tidegate, profile, "closed", concurrency, None)
            return direct, ours

        direct, ours = run_async(both())
    overhead_bench._add_ratios([direct, ours])  # the bench's own TTFT overhead and throughput ratio
    if not ours.get("cpu_us_per_chunk") or "ttft_overhead_ms" not in ours:
        raise TidegateError(f"tidegate relayed nothing in the window: {ours.get('errors')}")
    itl = ours.get("itl_ms") or {}
    return {"us_per_chunk": ours["cpu_us_per_chunk"], "cpu_s": ours["cpu_s"],
            "ttft_overhead_ms": [ours["ttft_overhead_ms"][p] for p in ("p50", "p99")],
            "itl_ms": [itl.get("p50", 0.0), itl.get("p99", 0.0)],
            "ratio": ours.get("throughput_ratio", 0.0),
            "errors": ours["error_count"], "tidegate": str(Path(__file__).parents[1])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.alternate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="*", help="NAME=tree:PATH or NAME=env:KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=200)
    parser.add_argument("--window", type=float, default=6.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--peer", choices=PEERS, default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        overrides = dict(BenchOptions.parse_set(args.set))
        print(json.dumps(_one(args.concurrency, args.window, args.warmup, overrides,
                              args.peer)))
        return 0
    try:
        variants = [parse_variant(v) for v in args.variants]
    except TidegateError as exc:
        parser.error(str(exc))
    if not variants:
        parser.error("name at least one variant")
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}", flush=True)
        # Every other round in reverse: the second run of a round cost 5-15 %
        # more CPU per chunk than the first, whichever tree it was (two 3-round
        # runs of the same pair in both orders), so a fixed order biases a pair.
        for variant in variants if round_ % 2 else variants[::-1]:
            child = subprocess.run(
                [sys.executable, "-m", "bench.alternate", "--one",
                 "--concurrency", str(args.concurrency), "--window", str(args.window),
                 "--warmup", str(args.warmup),
                 *(arg for setting in variant.settings for arg in ("--set", setting)),
                 *(["--peer", variant.peer] if variant.peer else [])],
                env=variant.environ(), cwd=variant.cwd, capture_output=True, text=True,
                check=False)
            if child.returncode != 0:
                print(f"{variant.name:>10}  failed:\n{child.stderr[-2000:]}", flush=True)
                return 1
            result = json.loads(child.stdout.strip().splitlines()[-1])
            print(summary_line(variant.name, result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
