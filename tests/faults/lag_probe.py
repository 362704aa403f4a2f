"""``python -m tests.faults.lag_probe PATH worker --config ...``: a worker whose
event loop lag is sampled (a 5 ms sleep's overshoot) and written to PATH, one
line ``<time.monotonic()> <worst lag of the last 50 ms>`` per 50 ms, so a
test can read how long the worker's loop stood still while it sent the
worker a request. A loop that stands still writes nothing until it
runs again: a reader takes the age of the last line as a lag too. Everything
else is ``tidegate`` as it ships."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from fleet.cli import main
from tidegate.config import Config
from workers import service

SAMPLE = 0.005
REPORT = 0.05


async def sample(path: Path) -> None:
    with path.open("a", buffering=1) as out:  # line-buffered: each report is read at once
        worst, since = 0.0, time.monotonic()
        while True:
            t = time.monotonic()
            await asyncio.sleep(SAMPLE)
            now = time.monotonic()
            worst = max(worst, now - t - SAMPLE)
            if now - since >= REPORT:
                out.write(f"{now:.6f} {worst:.6f}\n")
                worst, since = 0.0, now


def patch(path: Path) -> None:
    serve = service.serve

    async def probed(config: Config, stop: asyncio.Event) -> None:
        probe = asyncio.create_task(sample(path))
        try:
            await serve(config, stop)
        finally:
            probe.cancel()

    service.serve = probed


if __name__ == "__main__":
    patch(Path(sys.argv.pop(1)))
    raise SystemExit(main())
