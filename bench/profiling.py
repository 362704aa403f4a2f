"""Optional py-spy profiles of the edge and the worker during a load window.

``tidegate bench --py-spy`` samples both processes with ``py-spy record
--format raw`` (collapsed stacks) for the measured window of the tidegate run
of scenario (a) closest to 200 concurrent streams, and summarises where the
busy samples go: by leaf frame (self time) and by every frame on the stack
(inclusive time). py-spy's sampling costs CPU too, so the numbers of a
profiled run are a little worse than those of an unprofiled one.
"""

from __future__ import annotations

import asyncio
import re
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.targets import Target

__all__ = ["PySpy", "summarize"]

_LINE = re.compile(r":\d+\)$")
_PREFIXES = (re.compile(r"^.*/site-packages/"), re.compile(r"^.*/lib/python3\.\d+/"),
             re.compile(r"^.*/work/main/"))


def _frame(raw: str) -> str:
    """``func (path/file.py:12)`` -> ``func (file path from its package)``."""
    frame = _LINE.sub(")", raw.strip())
    name, _, path = frame.partition(" (")
    for prefix in _PREFIXES:
        path = prefix.sub("", path)
    return f"{name} ({path}" if path else name


# uvloop is C: time in its loop (polling, socket syscalls, C callbacks) shows
# as the self time of the Python frame that entered it.
_LOOP = "Runner.run (asyncio/runners.py)"
_LOOP_NAME = "event loop: uvloop C code (epoll, socket syscalls, callbacks)"
# Ancestors of every sample: they say nothing in an inclusive ranking.
_ENTRY = ("<frozen runpy>", "tidegate/__main__.py", "fleet/cli/", "fleet/run/runtime.py",
          "asyncio/runners.py")
_AREAS = (("aiohttp/", "aiohttp"), ("nats/", "nats-py"), ("asyncio/", "asyncio (Python)"),
          ("edge/", "tidegate edge/"), ("workers/", "tidegate workers/"),
          ("dispatcher/", "tidegate dispatcher/"), ("tidegate/", "tidegate core"),
          ("msgpack", "msgpack"), ("json/", "json"))


def _area(frame: str) -> str:
    if frame == _LOOP_NAME:
        return "event loop (uvloop, C)"
    path = frame.partition(" (")[2]
    return next((name for prefix, name in _AREAS if path.startswith(prefix)), "other")


def summarize(raw_file: Path, top: int = 20) -> dict[str, Any]:
    """Self, inclusive and per-library shares (percent of busy samples) of a
    raw py-spy file."""
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    areas: Counter[str] = Counter()
    total = 0
    for line in raw_file.read_text(errors="replace").splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_frame(f) for f in stack.split(";") if f.strip()]
        # py-spy puts the thread name first when it has one: not a frame.
        frames = [f for f in frames if "(" in f] or frames
        if not frames:
            continue
        total += count
        leaf = _LOOP_NAME if frames[-1] == _LOOP else frames[-1]
        self_time[leaf] += count
        areas[_area(leaf)] += count
        for f in dict.fromkeys(frames):  # once per sample; outer frames first on ties
            if not any(e in f for e in _ENTRY):
                inclusive[f] += count

    def share(counter: Counter[str]) -> list[list[Any]]:
        return [[name, round(100.0 * n / total, 1)] for name, n in counter.most_common(top)]

    return {"samples": total, "self_pct": share(self_time) if total else [],
            "inclusive_pct": share(inclusive) if total else [],
            "area_pct": share(areas) if total else []}


class PySpy:
    """Profiles a target's edge and worker for the measured window of one run."""

    def __init__(self, out: Path, rate: int = 100,
                 tiers: tuple[str, ...] = ("edge", "worker")) -> None:
        self.out = out
        self.rate = rate
        self.tiers = tiers  # the processes sampled (Target.memory's names)
        self.binary = shutil.which("py-spy")
        self.results: dict[str, Any] = {}

    @property
    def available(self) -> bool:
        return self.binary is not None

    @asynccontextmanager
    async def window(self, target: Target, delay: float, duration: float,
                     label: str) -> AsyncIterator[None]:
        assert self.binary is not None
        files: dict[str, Path] = {}
        procs: list[asyncio.subprocess.Process] = []

        async def record() -> None:
            await asyncio.sleep(delay)
            for name in self.tiers:
                proc = target.memory.get(name) or target.cpu.get(name)
                if proc is None or proc.pid is None:
                    continue
                files[name] = self.out / f"pyspy-{target.name}-{name}-{label}.txt"
                procs.append(await asyncio.create_subprocess_exec(
                    str(self.binary), "record", "--pid", str(proc.pid), "--rate", str(self.rate),
                    "--duration", str(max(1, round(duration))), "--format", "raw",
                    "--nonblocking", "--output", str(files[name]),
                    stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL))

        starter = asyncio.create_task(record())
        try:
            yield
            await starter
            for p in procs:
                await p.wait()
        finally:
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            for p in procs:
                if p.returncode is None:
                    p.kill()
                    await p.wait()
        for name, path in files.items():
            if path.exists():
                self.results[f"{target.name}/{name}/{label}"] = {
                    "file": path.name, **summarize(path)}
