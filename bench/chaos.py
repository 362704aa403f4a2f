"""``tidegate chaos``: streaming load against a local fleet while SIGKILLing its processes.

The fleet (:class:`bench.chaos_fleet.Fleet`): 3 JetStream nodes (R3 streams),
one Redis, 2 dispatchers, 2 workers on the simulator, 2 edges on one port. The
load (:func:`stream_once`): streaming chats whose exact text is known in-process
(:func:`expected_text`), each classified (:class:`Outcome`): ``complete``,
``clean_error`` (an error status or final error event), ``connection_lost``,
``truncated`` (a normal end with wrong or missing text: silent loss) or
``hang``. The killer (:func:`chaos`): at seeded random times one process of a
random kind is SIGKILLed and restarted by a
:class:`~fleet.run.supervisor.Supervisor`. Target: every stream completes.
Docs: docs/reliability.md#tidegate-chaos.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.chaos_fleet import DEV_KEY, MODEL, Fleet
from tidegate.config import Config

KINDS = ("edge", "dispatcher", "worker", "nats", "redis")
DEFAULTS_KINDS = ("dispatcher", "worker", "nats")  # what --defaults kills


# -- one request, classified -----------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """What one request ended as (see the module docstring)."""

    kind: str
    code: str = ""
    ttft: float | None = None  # seconds to the first content chunk
    max_stall: float = 0.0  # longest gap between chunks
    started: float = 0.0  # monotonic
    duration: float = 0.0
    accepted: bool = False  # HTTP 200 came: the stream had begun when it ended
    resumes: int = 0  # reconnections of a resumable stream (GET /v1/streams/{id})
    resent: int = 0  # the request sent again under its Idempotency-Key (cut before its 200)
    request_id: str = ""  # x-request-id, once the stream began (the tiers' logs name it)


async def expected_text(config: Config, prompt: str, max_tokens: int) -> str:
    """What the deterministic simulator answers ``prompt`` (computed in-process)."""
    from tidegate.wire.protocol import Api, Request
    from workers.backends.simulator import SimulatorBackend

    model = config.models[0]
    fast = type(model.simulator)(ttft=0.0, tokens_per_second=1e6, length=model.simulator.length,
                                 deterministic=model.simulator.deterministic)
    backend = SimulatorBackend(type(model)(name=model.name, simulator=fast))
    request = Request(id="expected", reply="-", model=model.name, api=Api.CHAT, stream=False,
                      body={"model": model.name, "max_tokens": max_tokens,
                            "messages": [{"role": "user", "content": prompt}]},
                      created_ms=0, deadline_ms=0, window_bytes=1 << 20, window_msgs=1024)
    stream = await backend.open(request)
    body = b""
    while chunk := await stream.read(1 << 20):
        body += chunk
    await stream.aclose()
    content: str = json.loads(body)["choices"][0]["message"]["content"]
    return content


def _error_code(body: Any) -> str | None:
    """The ``code`` of an OpenAI error body, or None if it is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        if isinstance(error.get("message"), str):
            return str(error.get("code") or error.get("type") or "error")
    return None


async def stream_once(session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int,
                      expected: str, hang_after: float, key: str = DEV_KEY, *,
                      resume: bool = False) -> Outcome:
    """One streaming chat completion against ``url`` (the edge origin), classified.

    With ``resume``, the request asks for a resumable stream, and a
    connection lost after the response began is not the end: the client
    reconnects (any edge behind the port) with ``GET /v1/streams/{id}`` and
    ``Last-Event-ID`` (docs/resume.md) until the stream ends or
    ``hang_after`` runs out. The text must still be exactly the expected
    one: a duplicated or skipped event shows as ``truncated``. A request
    cut before its response began (its edge died) carries an
    ``Idempotency-Key`` and is sent again under it until it begins: the same
    request on any edge, never a second one (docs/resume.md).
    """
    started = time.monotonic()
    out = Outcome("hang", started=started)
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": prompt}]}
    auth = {"Authorization": f"Bearer {key}"}
    content: list[str] = []
    last = started
    last_id = 0  # the id of the last event taken in (resumable streams)
    request_id = ""

    async def consume(resp: aiohttp.ClientResponse) -> bool:
        """Read events into ``content``; True at [DONE], False at a clean
        error (``out`` says which) or a normal end without either."""
        nonlocal last, last_id
        event_id = 0
        reconnect = False
        async for line in resp.content:
            if not line.endswith(b"\n"):  # cut short: the connection was lost
                raise ConnectionResetError("the body ended inside a line")
            if line.startswith(b"id:"):
                event_id = int(line[3:].strip() or 0)
                continue
            if line.startswith(b"event: reconnect"):
                # The edge sends its client elsewhere (its worker died and the
                # stream goes on in its log, or the edge drains): resume.
                reconnect = True
                continue
            if not line.startswith(b"data: "):
                continue
            if reconnect:
                last_id = int(json.loads(line[6:])["last_event_id"])
                raise _Reconnect
            if event_id:
                last_id = event_id
            now = time.monotonic()
            out.max_stall = max(out.max_stall, now - last)
            last = now
            data = line[6:].strip()
            if data == b"[DONE]":
                return True
            event = json.loads(data)
            code = _error_code(event)
            if code is not None:
                out.kind, out.code = "clean_error", code
                return False
            for choice in event.get("choices", ()):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and out.ttft is None:
                    out.ttft = now - started
                content.append(piece)
        # The body ended properly (its chunked terminator) without [DONE] or
        # an error: a silent truncation. A vanished peer raises instead.
        raise _Ended

    def finish(done: bool) -> Outcome:
        if out.kind == "clean_error":
            return out
        text = "".join(content)
        if done and text == expected:
            out.kind = "complete"
        elif done:
            out.kind, out.code = "truncated", f"[DONE] after {len(text)}/{len(expected)}"
        else:
            out.kind, out.code = "truncated", "ended without [DONE] or an error"
        return out

    try:
        async with asyncio.timeout(hang_after):
            headers = ({**auth, "X-Tidegate-Resumable": "true",
                        "Idempotency-Key": uuid.uuid4().hex} if resume else auth)
            while True:
                try:
                    async with session.post(f"{url}/v1/chat/completions", json=body,
                                            headers=headers) as resp:
                        if resp.status != 200:
                            raw = await resp.read()
                            try:
                                code = _error_code(json.loads(raw))
                            except ValueError:
                                code = None
                            out.kind, out.code = ("clean_error", code) if code else (
                                "truncated", f"HTTP {resp.status} without an OpenAI error body")
                            return out
                        out.accepted = True
                        request_id = out.request_id = resp.headers.get("x-request-id", "")
                        return finish(await consume(resp))
                except _Ended:
                    return finish(False)  # a proper end without [DONE]: never resumed over
                except _Reconnect:
                    pass
                except (aiohttp.ClientError, ConnectionError):
                    if resume and not out.accepted:
                        out.resent += 1  # the same request again, on whichever edge is up
                        await asyncio.sleep(0.2)
                        continue
                    if not (resume and out.accepted and request_id):
                        raise
                break
            # Resume: the stream goes on in the log; any edge serves it.
            while True:
                out.resumes += 1
                try:
                    async with session.get(f"{url}/v1/streams/{request_id}",
                                           headers={**auth, "Last-Event-ID": str(last_id)}
                                           ) as resp:
                        if resp.status == 200:
                            try:
                                return finish(await consume(resp))
                            except _Ended:
                                return finish(False)
                            except _Reconnect:
                                continue
                        await resp.read()
                        if resp.status == 404:  # the log lost it: a real failure
                            out.kind, out.code = "clean_error", "stream_not_found"
                            return out
                except (aiohttp.ClientError, ConnectionError):
                    pass
                await asyncio.sleep(0.2)  # the edge restarting, or none up yet
    except TimeoutError:
        out.kind, out.code = "hang", f"no end within {hang_after:g}s"
    except (aiohttp.ClientError, ConnectionError) as exc:
        out.kind, out.code = "connection_lost", type(exc).__name__
    finally:
        out.duration = time.monotonic() - started
    return out


class _Ended(Exception):
    """A response body ended without [DONE] or an error event."""


class _Reconnect(Exception):
    """The response ended with ``event: reconnect``: resume from ``last_id``."""


@dataclass(slots=True)
class Load:
    """Closed-loop streaming clients; every outcome kept."""

    url: str
    config: Config
    concurrency: int = 8
    max_tokens: int = 32
    hang_after: float = 45.0
    key: str = DEV_KEY
    resume: bool = True  # resumable streams, resumed after a lost connection
    outcomes: list[Outcome] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``; then the requests in flight finish (or count as hangs)."""
        connector = aiohttp.TCPConnector(limit=0, force_close=True)  # new conn: any edge
        async with aiohttp.ClientSession(connector=connector) as session:
            await asyncio.gather(*(self._client(session, i, stop)
                                   for i in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, i: int,
                      stop: asyncio.Event) -> None:
        n = 0
        while not stop.is_set():
            prompt = f"chaos client {i} request {n}"
            n += 1
            expected = await expected_text(self.config, prompt, self.max_tokens)
            outcome = await stream_once(session, self.url, prompt, self.max_tokens, expected,
                                        self.hang_after, self.key, resume=self.resume)
            self.outcomes.append(outcome)
            if outcome.kind != "complete":
                # A client backs off after an error (as Retry-After asks);
                # without it one outage would be counted thousands of times.
                await asyncio.sleep(0.5)


def summarize(outcomes: list[Outcome], since: float = 0.0) -> dict[str, Any]:
    """Counts by kind and error code, TTFT and stall percentiles."""
    chosen = [o for o in outcomes if o.started >= since]
    ttfts = sorted(o.ttft for o in chosen if o.ttft is not None)
    stalls = sorted(o.max_stall for o in chosen if o.kind == "complete")
    # The longest pause of each stream that resumed (an edge's death, or its
    # worker's: the seam), TTFT included as the pause before the first event.
    seams = sorted(o.max_stall for o in chosen if o.kind == "complete" and o.resumes)

    def pct(values: list[float], p: float) -> float | None:
        return round(values[min(len(values) - 1, int(p * len(values)))], 4) if values else None

    return {
        "requests": len(chosen),
        "kinds": dict(Counter(o.kind for o in chosen)),
        "codes": dict(Counter(f"{o.kind}:{o.code}" for o in chosen if o.code)),
        # Streams that had begun (HTTP 200) and did not complete: what a
        # client reading a stream saw go wrong.
        "accepted_not_complete": dict(Counter(
            f"{o.kind}:{o.code}" for o in chosen if o.accepted and o.kind != "complete")),
        "ttft_p50": pct(ttfts, 0.5), "ttft_p99": pct(ttfts, 0.99),
        "ttft_max": ttfts[-1] if ttfts else None,
        "stall_p99": pct(stalls, 0.99), "stall_max": stalls[-1] if stalls else None,
        "ttft_mean": round(statistics.fmean(ttfts), 4) if ttfts else None,
        # Resumable streams carried over a lost connection (any edge).
        "resumed_streams": sum(1 for o in chosen if o.resumes),
        "resumed_complete": sum(1 for o in chosen if o.resumes and o.kind == "complete"),
        "resumed_stall_p50": pct(seams, 0.5), "resumed_stall_p99": pct(seams, 0.99),
        "resumed_stall_max": seams[-1] if seams else None,
        # Requests cut before their 200 and sent again under their key.
        "resent_requests": sum(1 for o in chosen if o.resent),
        "resent_complete": sum(1 for o in chosen if o.resent and o.kind == "complete"),
    }


# -- chaos ---------------------------------------------------------------------


@dataclass(slots=True)
class Kill:
    at: float  # seconds since the load started
    kind: str
    name: str
    down_for: float  # until the supervisor had it running again


async def killer(fleet: Fleet, stop: asyncio.Event, rng: random.Random, t0: float,
                 interval: tuple[float, float], kinds: tuple[str, ...],
                 kills: list[Kill]) -> None:
    """SIGKILL a random process every ``interval`` s and restart it.

    Kinds come in shuffled rounds, so every kind is hit once per
    ``len(kinds)`` kills; the process of that kind is picked at random.
    """
    order: list[str] = []
    while True:
        try:
            await asyncio.wait_for(stop.wait(), rng.uniform(*interval))
            return
        except TimeoutError:
            pass
        if not order:
            order = list(kinds)
            rng.shuffle(order)
        kind = order.pop()
        victim = rng.choice(fleet.processes(kind))
        state = fleet.supervisor.states[victim.name]
        before = state.restarts
        kills.append(Kill(round(time.monotonic() - t0, 2), kind, victim.name, 0.0))
        await asyncio.to_thread(victim.kill)
        # The supervisor (another thread) restarts it; poll its state.
        while state.restarts == before or not victim.running:
            if fleet.failure is not None:
                return
            await asyncio.sleep(0.05)
        kills[-1].down_for = round(time.monotonic() - t0 - kills[-1].at, 2)
        if kind == "nats":
            # Back in the cluster before the next kill: killing a second node
            # while the first is still down loses the R3 quorum by design.
            await asyncio.to_thread(fleet.nats.wait_healthy, 60.0)


async def served(url: str, config: Config, within: float = 90.0) -> None:
    """Until one stream has gone through every tier: the edge's ``/readyz``
    says the edge is up, not that a worker pulls yet (its JetStream calls
    wait for the new cluster's leaders), and the first requests of the
    load would wait for it, a stall nobody's kill caused."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while True:
            expected = await expected_text(config, "warm up", 4)
            out = await stream_once(session, url, "warm up", 4, expected, 30.0)
            if out.kind == "complete":
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no stream through the fleet within {within:g}s: "
                                   f"{out.kind} {out.code}")
            await asyncio.sleep(0.5)


async def chaos(workdir: Path, duration: float = 60.0, concurrency: int = 8, seed: int = 1,
                interval: tuple[float, float] = (3.0, 6.0),
                kinds: tuple[str, ...] | None = None, resume: bool = True,
                backends: int = 0, defaults: bool = False) -> dict[str, Any]:
    """Run the fleet, the load and the killer; the report. ``kinds``: every
    kind of the fleet by default (``backend`` with ``backends``), the
    defaults bar's with ``defaults`` (which also makes the clients plain)."""
    fleet = Fleet(workdir, backends=backends, defaults=defaults)
    if defaults:
        resume = False
    if kinds is None:
        base = DEFAULTS_KINDS if defaults else KINDS
        kinds = (*base, "backend") if backends else base
    await asyncio.to_thread(fleet.start)
    try:
        await served(fleet.url, fleet.config)
    except BaseException:
        await asyncio.to_thread(fleet.stop)
        raise
    stop_supervisor = threading.Event()
    supervisor = asyncio.create_task(asyncio.to_thread(fleet.supervise, stop_supervisor))
    try:
        rng = random.Random(seed)
        load = Load(fleet.url, fleet.config, concurrency=concurrency, resume=resume)
        stop_load, stop_killer = asyncio.Event(), asyncio.Event()
        kills: list[Kill] = []
        t0 = time.monotonic()
        load_task = asyncio.create_task(load.run(stop_load))
        kill_task = asyncio.create_task(killer(fleet, stop_killer, rng, t0, interval, kinds,
                                               kills))
        await asyncio.wait({supervisor}, timeout=duration)  # done early: it gave up
        stop_killer.set()
        await kill_task
        stop_load.set()
        await load_task
    finally:
        stop_supervisor.set()
        await supervisor
        await asyncio.to_thread(fleet.stop)
    report = summarize(load.outcomes)
    # When the long pauses happened, to set beside the kills: [start of the
    # request (s since the load began), its longest pause], pauses over 1 s.
    report["slow_streams"] = [[round(o.started - t0, 2), round(o.max_stall, 2)]
                              for o in load.outcomes if o.kind == "complete"
                              and o.max_stall > 1.0]
    # The streams that began and did not complete, to look up in the tiers'
    # logs (--workdir keeps them): [start, kind:code, request id].
    report["failed_streams"] = [[round(o.started - t0, 2), f"{o.kind}:{o.code}", o.request_id]
                                for o in load.outcomes
                                if o.accepted and o.kind != "complete"]
    restarts = fleet.restarts()
    report.update(duration_s=duration, concurrency=concurrency, seed=seed, resume=resume,
                  backends=backends, defaults=defaults,
                  kills=[asdict(k) for k in kills],
                  kills_by_kind=dict(Counter(k.kind for k in kills)),
                  restarts=restarts,
                  # Exits nobody caused: a tier that crashed on its own.
                  unexpected_exits=sum(restarts.values()) - len(kills))
    return report


def run(duration: float, concurrency: int, seed: int, out: Path | None,
        workdir: Path | None = None, resume: bool = True, backends: int = 0,
        defaults: bool = False) -> int:
    """``tidegate chaos``: print (and write) the report; exit 1 on a silent loss
    or hang, and with ``defaults`` on any stream that began and did not complete."""
    with tempfile.TemporaryDirectory(prefix="tidegate-chaos-") as tmp:
        report = asyncio.run(chaos(workdir or Path(tmp), duration, concurrency, seed,
                                   resume=resume, backends=backends, defaults=defaults))
    text = json.dumps(report, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
    bad = report["kinds"].get("truncated", 0) + report["kinds"].get("hang", 0)
    if defaults:
        bad += sum(report["accepted_not_complete"].values())
    return 1 if bad else 0
