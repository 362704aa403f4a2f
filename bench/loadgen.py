"""The load generator: SSE streams over aiohttp, measured on the client side.

:func:`closed_loop`: a fixed number of users, each sending its next request when
its stream ends. :func:`open_loop`: Poisson arrivals at a fixed rate, latencies
from the *scheduled* send time, so a stalled generator or target cannot hide
queueing (coordinated omission).

Both measure inside a window ``[t0, t1)`` after a warm-up: latencies of streams
scheduled in it, chunks and streams that arrived in it, so throughput and the
CPU window cover the same seconds. SSE parsing is minimal, so the generator is
not the bottleneck. Times are ``time.monotonic()``, one clock for every process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.procstats import CpuWindow

__all__ = [
    "Endpoint",
    "Recorder",
    "SlowResult",
    "chat_body",
    "closed_loop",
    "distribution",
    "messages_body",
    "new_session",
    "open_loop",
    "percentile",
    "responses_body",
    "slow_stream",
    "stream_once",
]

_DONE = b"data: [DONE]"
_COMPLETED = b'"type":"response.completed"'
_STOPPED = b'"type":"message_stop"'  # the end of an Anthropic Messages stream
_ERROR = b'data: {"error"'


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a target takes chat completions (or, with ``path`` =
    ``/responses`` or ``/messages``, Responses or Anthropic Messages streams)."""

    name: str
    base_url: str  # ends in /v1
    model: str
    headers: Mapping[str, str] = field(default_factory=dict)
    path: str = "/chat/completions"

    @property
    def chat_url(self) -> str:
        return f"{self.base_url}{self.path}"

    @property
    def typed_events(self) -> bool:
        """Responses and Messages streams: ``event:`` lines, ending with
        response.completed or message_stop."""
        return self.path in ("/responses", "/messages")


def chat_body(model: str, *, tokens: int, itl: float, ttft: float,
              bench_id: str | None = None) -> bytes:
    """A streaming chat request; ``fake_*`` fields set the fake backend's pace
    per request (gateways forward unknown fields untouched)."""
    body: dict[str, Any] = {
        "model": model, "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Benchmark prompt."}],
        "fake_ttft": ttft, "fake_itl": itl}
    if bench_id is not None:
        body["bench_id"] = bench_id
    return json.dumps(body, separators=(",", ":")).encode()


def responses_body(model: str, *, tokens: int, itl: float, ttft: float) -> bytes:
    """A streaming Responses API request of ``tokens`` output tokens, paced
    like :func:`chat_body`'s."""
    body: dict[str, Any] = {
        "model": model, "stream": True, "max_output_tokens": tokens,
        "input": "Benchmark prompt.", "fake_ttft": ttft, "fake_itl": itl}
    return json.dumps(body, separators=(",", ":")).encode()


def messages_body(model: str, *, tokens: int, itl: float, ttft: float) -> bytes:
    """A streaming Anthropic Messages request of ``tokens`` output tokens,
    paced like :func:`chat_body`'s."""
    body: dict[str, Any] = {
        "model": model, "stream": True, "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Benchmark prompt."}],
        "fake_ttft": ttft, "fake_itl": itl}
    return json.dumps(body, separators=(",", ":")).encode()


def new_session(timeout: float = 300.0) -> aiohttp.ClientSession:
    """A client session without a connection cap, for one target and one run."""
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False,
        timeout=aiohttp.ClientTimeout(total=timeout, sock_connect=30.0))


def percentile(sorted_values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of already sorted values (0 <= p <= 100)."""
    if not sorted_values:
        return float("nan")
    rank = round(p / 100.0 * (len(sorted_values) - 1))
    return sorted_values[min(len(sorted_values) - 1, max(0, rank))]


def distribution(values: Sequence[float], scale: float = 1000.0) -> dict[str, float | int]:
    """count, mean, p50, p90, p99, max of ``values`` times ``scale`` (ms by default)."""
    s = sorted(values)
    if not s:
        return {"count": 0}
    return {"count": len(s), "mean": round(sum(s) / len(s) * scale, 3),
            "p50": round(percentile(s, 50) * scale, 3),
            "p90": round(percentile(s, 90) * scale, 3),
            "p99": round(percentile(s, 99) * scale, 3),
            "max": round(s[-1] * scale, 3)}


class Recorder:
    """Outcomes of the streams of one run (one target, one load level)."""

    def __init__(self) -> None:
        self.t0 = float("inf")
        self.t1 = float("inf")
        self.ttft = array("d")
        self.total = array("d")
        self.itl = array("d")
        self.errors: Counter[str] = Counter()
        self.sent = 0
        self.completed = 0
        self.chunks = 0  # data events received (any time)
        self.pings = 0  # SSE comments received
        self.window_chunks = 0
        self.window_completed = 0
        self.inflight = 0
        self.cpu: CpuWindow | None = None

    def set_window(self, t0: float, duration: float) -> None:
        self.t0, self.t1 = t0, t0 + duration

    async def run_window(self) -> None:
        """Sleep to ``t0``, start the CPU window, sleep to ``t1``, stop it."""
        await asyncio.sleep(max(0.0, self.t0 - time.monotonic()))
        if self.cpu is not None:
            self.cpu.start()
        await asyncio.sleep(max(0.0, self.t1 - time.monotonic()))
        if self.cpu is not None:
            self.cpu.stop()

    def summary(self) -> dict[str, Any]:
        window = self.t1 - self.t0
        return {
            "sent": self.sent,
            "completed": self.completed,
            "errors": dict(self.errors),
            "error_count": sum(self.errors.values()),
            "window_s": round(window, 3),
            "streams_per_s": round(self.window_completed / window, 2),
            "chunks_per_s": round(self.window_chunks / window, 1),
            "window_chunks": self.window_chunks,
            "window_completed": self.window_completed,
            "ttft_ms": distribution(self.ttft),
            "itl_ms": distribution(self.itl),
            "total_ms": distribution(self.total),
        }


async def stream_once(session: aiohttp.ClientSession, endpoint: Endpoint, body: bytes,
                      rec: Recorder, scheduled: float, *,
                      cancel_after: int | None = None,
                      explicit_cancel: bool = False) -> float | None:
    """One streaming request; its outcome goes into ``rec``.

    With ``cancel_after``, the connection is closed once that many data
    events arrived, and the time of the close is returned (None when the
    stream ended or failed first). With ``explicit_cancel`` too, the stream
    is cancelled by ``POST /v1/streams/{x-request-id}/cancel`` instead (the
    time returned is that request's send), and its events are read to their
    end. Events of a resumable stream (``id:``, ``retry:`` lines) count as
    their data line.
    """
    sample = rec.t0 <= scheduled < rec.t1
    rec.sent += 1
    rec.inflight += 1
    first = last = 0.0
    chunks = 0
    done = False
    error: str | None = None
    closed_at: float | None = None
    itls: list[float] = []
    typed = endpoint.typed_events  # once per stream; for chat one bool test per event
    try:
        async with session.post(endpoint.chat_url, data=body, headers=endpoint.headers) as resp:
            if resp.status != 200:
                await resp.read()
                error = f"http_{resp.status}"
            else:
                buf = b""
                async for data in resp.content.iter_any():
                    now = time.monotonic()
                    buf += data
                    if b"\n\n" not in buf:
                        continue
                    *events, buf = buf.split(b"\n\n")
                    n = 0
                    for event in events:
                        if event.startswith((b"id:", b"retry:")):  # a resumable stream's
                            i = event.find(b"\ndata:")
                            event = event[i + 1:] if i >= 0 else b""
                        if typed and event.startswith(b"event:"):
                            if event.startswith(b"event: error"):
                                error = "error_event"
                            event = event[event.find(b"\n") + 1:]
                            if event.find(_COMPLETED) >= 0 or event.find(_STOPPED) >= 0:
                                done = True
                        if event.startswith(b"data:"):
                            if event.startswith(_DONE):
                                done = True
                            elif event.startswith(_ERROR):
                                error = "error_event"
                            else:
                                n += 1
                        elif event.startswith(b":"):
                            rec.pings += 1
                    if not n:
                        continue
                    if chunks == 0:
                        first = now
                    elif sample:
                        itls.append(now - last)
                    if sample and n > 1:
                        itls.extend([0.0] * (n - 1))  # arrived in the same read
                    last = now
                    chunks += n
                    rec.chunks += n
                    if rec.t0 <= now < rec.t1:
                        rec.window_chunks += n
                    if cancel_after is not None and chunks >= cancel_after:
                        if explicit_cancel:
                            if closed_at is None:
                                rid = resp.headers.get("x-request-id", "")
                                closed_at = time.monotonic()
                                async with session.post(
                                        f"{endpoint.base_url}/streams/{rid}/cancel",
                                        headers=endpoint.headers) as answer:
                                    await answer.read()
                            continue  # read on to the final "cancelled" event
                        closed_at = time.monotonic()
                        resp.close()  # closes the socket, not back to the pool
                        break
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        error = type(exc).__name__
    finally:
        rec.inflight -= 1
    end = time.monotonic()
    if closed_at is not None:
        return closed_at
    if error is None and not done:
        error = "incomplete"
    if error is not None:
        rec.errors[error] += 1
        return None
    rec.completed += 1
    if rec.t0 <= end < rec.t1:
        rec.window_completed += 1
    if sample and chunks:
        rec.ttft.append(first - scheduled)
        rec.total.append(end - scheduled)
        rec.itl.extend(itls)
    return None


BodyFactory = Callable[[], bytes]


async def closed_loop(session: aiohttp.ClientSession, endpoint: Endpoint, make_body: BodyFactory,
                      rec: Recorder, *, concurrency: int, warmup: float, duration: float,
                      ramp: float | None = None) -> None:
    """``concurrency`` users back to back; users start spread over ``ramp``
    seconds (default: half the warm-up) so connects do not arrive as one burst."""
    start = time.monotonic()
    rec.set_window(start + warmup, duration)
    spread = warmup / 2 if ramp is None else ramp

    async def user(i: int) -> None:
        await asyncio.sleep(spread * i / concurrency)
        while (now := time.monotonic()) < rec.t1:
            await stream_once(session, endpoint, make_body(), rec, now)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(rec.run_window())
        users = [tg.create_task(user(i)) for i in range(concurrency)]
        tg.create_task(_bound_drain(users, rec))


# After the window, streams still open get this long to end; the rest are
# cancelled and counted (a gateway that melts at 2,000 streams would
# otherwise hold the run for the session's whole 300 s timeout per stream).
DRAIN_AFTER_WINDOW = 30.0


async def _bound_drain(tasks: list[asyncio.Task[None]], rec: Recorder) -> None:
    await asyncio.sleep(max(0.0, rec.t1 - time.monotonic()))
    _, pending = await asyncio.wait(tasks, timeout=DRAIN_AFTER_WINDOW)
    if pending:
        rec.errors["unfinished_after_window"] += len(pending)
        for task in pending:
            task.cancel()


async def open_loop(session: aiohttp.ClientSession, endpoint: Endpoint, make_body: BodyFactory,
                    rec: Recorder, *, rate: float, warmup: float, duration: float,
                    seed: int = 1, max_inflight: int = 5000) -> None:
    """Poisson arrivals at ``rate`` per second. Each stream's latencies are
    taken from its scheduled time; arrivals beyond ``max_inflight`` open
    streams are not sent and count as ``loadgen_overflow`` errors."""
    rng = random.Random(seed)
    t = time.monotonic() + 0.05
    rec.set_window(t + warmup, duration)
    streams: list[asyncio.Task[Any]] = []
    async with asyncio.TaskGroup() as tg:
        tg.create_task(rec.run_window())
        while True:
            t += rng.expovariate(rate)
            if t >= rec.t1:
                break
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if rec.inflight >= max_inflight:
                rec.errors["loadgen_overflow"] += 1
                continue
            streams.append(tg.create_task(stream_once(session, endpoint, make_body(), rec, t)))
        tg.create_task(_bound_drain(streams, rec))


@dataclass(slots=True)
class SlowResult:
    bytes_read: int = 0
    status_line: str = ""
    error: str | None = None


async def slow_stream(host: str, port: int, path: str, body: bytes, headers: Mapping[str, str],
                      *, bytes_per_s: int, duration: float, rcvbuf: int = 4096) -> SlowResult:
    """A client that reads ``bytes_per_s`` for ``duration`` seconds through a
    small receive buffer, then hangs up. Raw HTTP/1.1 over an asyncio stream
    whose own buffer is also small, so the backlog stays in the server."""
    result = SlowResult()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    writer: asyncio.StreamWriter | None = None
    try:
        await loop.sock_connect(sock, (host, port))
        reader, writer = await asyncio.open_connection(sock=sock, limit=rcvbuf)
        head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                "Connection: close", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        writer.write("\r\n".join(head).encode() + body)
        await writer.drain()
        step = 0.1
        per_step = max(1, int(bytes_per_s * step))
        deadline = time.monotonic() + duration
        while time.monotonic() < deadline:
            data = await reader.read(per_step)
            if not data:
                break
            if not result.status_line:
                result.status_line = data.split(b"\r\n", 1)[0].decode(errors="replace")
            result.bytes_read += len(data)
            await asyncio.sleep(step)
    except (OSError, TimeoutError) as exc:
        result.error = type(exc).__name__
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        else:
            sock.close()
    return result
