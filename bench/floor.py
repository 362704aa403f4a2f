"""The design's floor: the least an edge -> JetStream -> worker pipeline costs.

    python -m bench.floor edge --nats URL --port P
    python -m bench.floor worker --nats URL --upstream http://127.0.0.1:8001/v1

The edge publishes a request's body on a work-queue JetStream stream (file
storage, the PubAck awaited) and relays what comes back on its mux subject;
the worker pulls jobs, posts them to the backend and sends the raw response
reads back through tidegate's own coalescing (:class:`tidegate.wire.mux.Outbox`),
and the edge acks every ``ACK_EVERY`` frames, the worker stopping at
``WINDOW`` unacked. Nothing else: no auth, quotas, usage, log, failover or
telemetry. tidegate over this is its feature tax (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
from typing import Any

import aiohttp
import msgpack
import nats
from aiohttp import web
from nats.js.api import ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from bench import run_async
from bench.baseline_proxy import serve_until_signal
from fleet.run.runtime import wait_for_signal
from tidegate.config import WorkerConfig
from tidegate.wire.mux import Outbox, batch_limit

STREAM, SUBJECT, DURABLE = "FLOOR", "floor.req", "floor-workers"
# The edge acks every 64 frames (tidegate acks at half its default
# session.window_msgs of 128); the worker stops at 256 unacked.
ACK_EVERY, WINDOW = 64, 256
_END = b""  # a session's last message
_SSE = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# -- the edge ------------------------------------------------------------------


class Edge:
    """One mux subscription; each request a queue of its session's messages."""

    def __init__(self, nc: Any, js: Any) -> None:
        self.nc, self.js = nc, js
        self.subject = f"floor.edge.{secrets.token_hex(4)}"
        self.sessions: dict[str, asyncio.Queue[bytes]] = {}

    async def on_mux(self, msg: Any) -> None:
        batch = msgpack.unpackb(msg.data)
        for i in range(2, len(batch), 2):
            queue = self.sessions.get(batch[i])
            if queue is not None:  # else its client left: dropped
                queue.put_nowait(batch[i + 1])

    async def chat(self, request: web.Request) -> web.StreamResponse:
        sid = secrets.token_hex(8)
        queue = self.sessions[sid] = asyncio.Queue()
        try:
            await self.js.publish(SUBJECT, await request.read(),
                                  headers={"sid": sid, "edge": self.subject})
            ack_to = (await queue.get()).decode()  # the worker's first message
            resp = web.StreamResponse(headers=_SSE)
            await resp.prepare(request)
            frames = 0
            while (data := await queue.get()) != _END:
                await resp.write(data)
                frames += 1
                if frames % ACK_EVERY == 0:
                    await self.nc.publish(ack_to, msgpack.packb([sid, frames]))
            await resp.write_eof()
            return resp
        finally:
            del self.sessions[sid]


async def serve_edge(url: str, host: str, port: int) -> None:
    nc = await nats.connect(url, name="floor-edge")
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT],
                                     retention=RetentionPolicy.WORK_QUEUE,
                                     storage=StorageType.FILE))
    edge = Edge(nc, js)
    await nc.subscribe(edge.subject, cb=edge.on_mux, pending_msgs_limit=-1,
                       pending_bytes_limit=-1)
    app = web.Application()
    app.router.add_get("/healthz", lambda _r: _ok())
    app.router.add_post("/v1/chat/completions", edge.chat)
    try:
        await serve_until_signal(app, host, port)
    finally:
        await nc.close()


async def _ok() -> web.Response:
    return web.Response(text="ok")


# -- the worker ----------------------------------------------------------------


class Worker:
    """Pulls jobs while it has room; each job one backend call relayed raw."""

    def __init__(self, nc: Any, upstream: str, outbox: Outbox) -> None:
        self.nc, self.outbox = nc, outbox
        self.url = f"{upstream.rstrip('/')}/chat/completions"
        self.ack_subject = f"floor.ack.{secrets.token_hex(4)}"
        self.acked: dict[str, int] = {}
        self.room: dict[str, asyncio.Event] = {}
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                          timeout=aiohttp.ClientTimeout(total=None))

    async def on_ack(self, msg: Any) -> None:
        sid, frames = msgpack.unpackb(msg.data)
        if sid in self.acked:
            self.acked[sid] = frames
            self.room[sid].set()

    async def job(self, msg: Any) -> None:
        sid, edge = msg.headers["sid"], msg.headers["edge"]
        self.acked[sid], self.room[sid] = 0, asyncio.Event()
        try:
            self.outbox.put(edge, sid, self.ack_subject.encode())
            sent = 0
            async with self.http.post(self.url, data=msg.data,
                                      headers={"Content-Type": "application/json"}) as up:
                async for data in up.content.iter_any():
                    while sent - self.acked[sid] >= WINDOW:
                        self.room[sid].clear()
                        await self.room[sid].wait()
                    self.outbox.put(edge, sid, data)
                    sent += 1
            self.outbox.put(edge, sid, _END)
            await msg.ack()
        finally:
            del self.acked[sid], self.room[sid]


async def serve_worker(url: str, upstream: str, slots: int) -> None:
    nc = await nats.connect(url, name="floor-worker")
    js = nc.jetstream()
    defaults = WorkerConfig()  # tidegate's coalescing, as shipped
    outbox = Outbox(nc.publish, batch_limit(defaults.coalesce_bytes, nc.max_payload),
                    defaults.coalesce_delay)
    outbox.start()
    worker = Worker(nc, upstream, outbox)
    await nc.subscribe(worker.ack_subject, cb=worker.on_ack)
    for _ in range(300):  # the edge creates the stream
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.stream_info(STREAM)
            break
        await asyncio.sleep(0.1)
    sub = await js.pull_subscribe(SUBJECT, DURABLE, stream=STREAM,
                                  config=ConsumerConfig(ack_wait=120, max_ack_pending=-1))
    room = asyncio.Event()
    stop = asyncio.ensure_future(wait_for_signal())
    running: set[asyncio.Task[None]] = set()  # the jobs holding a slot

    def done(task: asyncio.Task[None]) -> None:
        running.discard(task)
        room.set()

    while not stop.done():
        if len(running) >= slots:
            room.clear()
            await room.wait()
            continue
        try:
            msgs = await sub.fetch(min(64, slots - len(running)), timeout=1.0)
        except TimeoutError:  # nothing to pull within 1 s; nats-py raises its own
            continue  # subclass, or asyncio's when the deadline ran out between steps
        for m in msgs:
            task = asyncio.create_task(worker.job(m))
            running.add(task)
            task.add_done_callback(done)
    await outbox.close()
    await worker.http.close()
    await nc.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.floor")
    parser.add_argument("role", choices=("edge", "worker"))
    parser.add_argument("--nats", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", default="")
    parser.add_argument("--slots", type=int, default=4096)
    args = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt):
        if args.role == "edge":
            run_async(serve_edge(args.nats, args.host, args.port))
        else:
            run_async(serve_worker(args.nats, args.upstream, args.slots))


if __name__ == "__main__":
    main()
