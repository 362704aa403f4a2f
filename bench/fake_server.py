"""The fake backend as its own process, with a control port for the benchmark.

The benchmark runs :class:`bench.fake_backend.FakeBackend` in a child
process so that it does not share one Python thread with the load generator
(either would throttle the other). The control port answers
``GET /records?since=ID`` with what the fake saw per request, including
``closed_at`` (``time.monotonic()``, which on Linux is the same clock in every
process, so the load generator can subtract its own close times from it).

    python -m bench.fake_server --port P --control-port Q
"""

from __future__ import annotations

import argparse
import contextlib

from aiohttp import web

from bench import run_async
from bench.fake_backend import FakeBackend, FakeConfig
from fleet.run.runtime import wait_for_signal


def _control_app(fake: FakeBackend) -> web.Application:
    async def records(request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        rows = [[r.id, r.body.get("bench_id"), r.started_at, r.closed_at, r.finished_at,
                 r.bytes_written, r.events_written, r.completed]
                for r in fake.records if r.id > since]
        return web.json_response({"fields": ["id", "bench_id", "started_at", "closed_at",
                                             "finished_at", "bytes_written", "events_written",
                                             "completed"], "records": rows})

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": bool(fake.base_url)})

    app = web.Application()
    app.router.add_get("/records", records)
    app.router.add_get("/healthz", healthz)
    return app


async def _serve(args: argparse.Namespace) -> None:
    # Records stay small: the benchmark reads them right after each scenario.
    fake = FakeBackend(FakeConfig(ttft=args.ttft, itl=args.itl, tokens=args.tokens,
                                  token_size=args.token_size, max_records=args.max_records,
                                  deterministic=args.deterministic,
                                  saturate_at=args.saturate_at))
    await fake.start(args.host, args.port)
    runner = web.AppRunner(_control_app(fake), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.control_port).start()
    try:
        await wait_for_signal()
    finally:
        await runner.cleanup()
        await fake.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--control-port", type=int, required=True)
    parser.add_argument("--ttft", type=float, default=0.05)
    parser.add_argument("--itl", type=float, default=0.01)
    parser.add_argument("--tokens", type=int, default=1_000_000,
                        help="upper bound; requests set max_tokens")
    parser.add_argument("--token-size", type=int, default=4)
    parser.add_argument("--max-records", type=int, default=20_000)
    parser.add_argument("--deterministic", action="store_true",
                        help="greedy-model text, assistant prefixes continued")
    parser.add_argument("--saturate-at", type=int, default=0,
                        help="past this many concurrent streams, slow down like a GPU batch")
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        run_async(_serve(args))


if __name__ == "__main__":
    main()
