"""CPU time and resident memory of processes, read from ``/proc`` (Linux only).

CPU is ``utime + stime`` from ``/proc/<pid>/stat`` (all threads of the process,
not its children), in seconds. Run-queue wait is the time the process's
threads were runnable but not running, waiting for a core (the second field
of ``/proc/<pid>/task/<tid>/schedstat``, summed over threads), in seconds: on
a machine with more runnable processes than cores it is where latency comes
from, and it is invisible in CPU time. RSS is ``VmRSS`` from
``/proc/<pid>/status``, in KiB. A process that has gone away reads as
``None``, so a window over a crashed tier shows up as missing rather than as a
bogus zero.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CpuWindow", "cpu_seconds", "raise_fd_limit", "rss_kib", "self_cpu_seconds",
           "wait_seconds"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds ``pid`` has used so far, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # The command name (field 2) may contain spaces and parentheses: split
    # after the last ')'. utime and stime are fields 14 and 15.
    fields = raw[raw.rfind(b")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def wait_seconds(pid: int) -> float | None:
    """Seconds the threads of ``pid`` spent runnable but waiting for a core, or
    None if it is gone (or the kernel keeps no schedstats)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def rss_kib(pid: int) -> int | None:
    """Resident set size of ``pid`` in KiB, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def self_cpu_seconds() -> float:
    """CPU seconds of this process (the load generator)."""
    t = os.times()
    return t.user + t.system


def raise_fd_limit(wanted: int = 65536) -> int:
    """Raise the soft open-files limit towards ``wanted`` (capped by the hard
    limit); children inherit it. Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


@dataclass(slots=True)
class CpuWindow:
    """CPU used by named processes between :meth:`start` and :meth:`stop`."""

    pids: Mapping[str, int]
    _before: dict[str, float | None] | None = None
    _waited_before: dict[str, float | None] | None = None
    _self_before: float = 0.0
    used: dict[str, float | None] | None = None
    waited: dict[str, float | None] | None = None  # run-queue wait, see wait_seconds
    self_used: float = 0.0

    def start(self) -> None:
        self._before = {name: cpu_seconds(pid) for name, pid in self.pids.items()}
        self._waited_before = {name: wait_seconds(pid) for name, pid in self.pids.items()}
        self._self_before = self_cpu_seconds()

    def stop(self) -> dict[str, float | None]:
        if self._before is None:
            raise RuntimeError("CpuWindow.stop() before start()")
        self.self_used = self_cpu_seconds() - self._self_before
        used: dict[str, float | None] = {}
        waited: dict[str, float | None] = {}
        for name, pid in self.pids.items():
            before, after = self._before[name], cpu_seconds(pid)
            used[name] = None if before is None or after is None else after - before
            assert self._waited_before is not None
            w0, w1 = self._waited_before[name], wait_seconds(pid)
            waited[name] = None if w0 is None or w1 is None else w1 - w0
        self.used, self.waited = used, waited
        return used
