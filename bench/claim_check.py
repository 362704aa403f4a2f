"""What the claim check costs a request (issue 45 item 4).

    python -m bench.claim_check [--sizes 1,4,20] [--runs 5]

Two stacks on tidegate's defaults and one fake backend, one after the other:
``claimed`` (nats-server's 1 MiB max_payload: a body over 512 KiB crosses by
the ``<P>_BODIES`` object store) and ``inline`` (a nats-server whose
max_payload takes the whole request, and ``edge.claim_check_bytes`` above it:
the body rides in the messages, as before the claim check). For each body
size, ``--runs`` streaming chat requests one at a time, each a fresh body of
that many MiB of text; reported: TTFT and total time (median, ms) per stack,
and what the claim check added (claimed - inline). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp

from bench import run_async
from bench.targets import MODEL, Target, Targets

MIB = 1 << 20
_INLINE_PAYLOAD = 64 * MIB


def body(size: int) -> bytes:
    """A streaming chat of ``size`` bytes of fresh text, 8 tokens out."""
    text = uuid.uuid4().hex * (size // 32)
    return json.dumps({"model": MODEL, "stream": True, "max_tokens": 8,
                       "messages": [{"role": "user", "content": text}],
                       "fake_ttft": 0.005, "fake_itl": 0.001}).encode()


async def one(session: aiohttp.ClientSession, target: Target, data: bytes) -> tuple[float, float]:
    """(TTFT, total) of one request, seconds."""
    start = time.monotonic()
    first = 0.0
    async with session.post(target.endpoint.chat_url, data=data,
                            headers={**target.endpoint.headers,
                                     "Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {(await resp.read())[:300]!r}")
        async for _ in resp.content.iter_any():
            if not first:
                first = time.monotonic() - start
    return first, time.monotonic() - start


async def measure(target: Target, sizes: list[int], runs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with aiohttp.ClientSession() as session:
        await one(session, target, body(1024))  # warm
        for mib in sizes:
            times = [await one(session, target, body(mib * MIB)) for _ in range(runs)]
            out[f"{mib}MiB"] = {"ttft_ms": round(statistics.median(t[0] for t in times) * 1000, 1),
                                "total_ms": round(statistics.median(t[1] for t in times) * 1000,
                                                  1)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,20", help="body sizes, MiB")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    results: dict[str, Any] = {}
    for name in ("claimed", "inline"):
        with Targets(Path(tempfile.mkdtemp(prefix="tidegate-claim-check-"))) as env:
            env.start_fake()
            inline = name == "inline"
            target = env.start_tidegate(
                nats_max_payload=_INLINE_PAYLOAD if inline else None,
                settings={"edge.claim_check_bytes": _INLINE_PAYLOAD} if inline else None)
            results[name] = run_async(measure(target, sizes, args.runs))
    results["added_ms"] = {
        size: {k: round(results["claimed"][size][k] - results["inline"][size][k], 1)
               for k in ("ttft_ms", "total_ms")} for size in results["claimed"]}
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
