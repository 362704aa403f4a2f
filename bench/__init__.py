"""The benchmark suite behind ``tidegate bench`` (docs/benchmarks.md).

Modules: :mod:`~bench.loadgen` (closed- and open-loop SSE load),
:mod:`~bench.targets` (fake backend, tidegate, the plain proxy and the peers as
child processes), :mod:`~bench.scenarios` (a run's profile; the scenarios in
``overhead_bench``, ``memory_bench``, ``cancel_bench``, ``telemetry_bench``),
:mod:`~bench.procstats` (CPU and RSS from ``/proc``), :mod:`~bench.report`
(JSON, markdown, plots), :mod:`~bench.quota` (scenario q), :mod:`~bench.runner`
(the command) and :mod:`~bench.alternate` (alternating A/B runs).

This module stays import-light: the child processes start from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` on uvloop when it is installed (tidegate's tiers use it too,
    so every process in a comparison runs the same loop), else on asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    result: T = uvloop.run(coro)
    return result
