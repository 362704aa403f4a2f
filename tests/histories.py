"""Streaming clients that keep their whole history, and the checker over them.

Each client runs resumable streaming chats in a loop against a list of edges
(hosts of their own: a client picks one, and after a lost connection resumes
with ``GET /v1/streams/{id}`` and ``Last-Event-ID`` on the next one, as a
client behind a load balancer would). Every event a client takes in is kept
(:class:`History`): its SSE id, its content, when it came.

The checker (:func:`check`) reads every history:

* ``complete``: ``[DONE]`` and the text exactly what the deterministic
  simulator answers that prompt (byte-exact);
* ``clean_error``: an HTTP error with an OpenAI error body, or a final error
  event; its code is kept;
* ``lost``: anything else once the request was accepted (no end within the
  hang bound, a body that ended without ``[DONE]`` or an error, a connection
  lost that could not be resumed): must be 0;
* ``duplicated``: events taken in twice (an SSE id seen again) plus, for a
  ``[DONE]`` stream whose text is not the expected one, the characters over
  or under it: must be 0.

Stall: the longest gap between two events of a stream, what its reader saw.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.chaos import expected_text
from tidegate.config import Config

RESUMABLE = {"X-Tidegate-Resumable": "true"}


@dataclass(slots=True)
class History:
    """One request as its client saw it."""

    prompt: str
    expected: str
    started: float
    events: list[tuple[int, str, float]] = field(default_factory=list)  # (id, content, at)
    done: bool = False
    accepted: bool = False
    error: str = ""  # the code of a clean error
    failure: str = ""  # why it is lost (set by the client)
    detail: str = ""  # a connect error's own words (which host, refused or unreachable)
    ended: float = 0.0
    resumes: int = 0
    reconnects: int = 0  # event: reconnect received (an edge gave the stream up)
    request_id: str = ""

    @property
    def text(self) -> str:
        return "".join(c for _, c, _ in self.events)

    def max_stall(self) -> float:
        times = [self.started] + [at for _, _, at in self.events]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


def _error_code(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        if isinstance(err.get("message"), str):
            return str(err.get("code") or err.get("type") or "error")
    return ""


class _Lost(Exception):
    """The body ended without ``[DONE]`` or an error event."""


class _Reconnect(Exception):
    """The edge ended the body with ``event: reconnect``: resume elsewhere."""


async def _consume(resp: aiohttp.ClientResponse, h: History) -> None:
    """Events into ``h`` until [DONE] or an error event (``h`` says which)."""
    event_id, name = 0, b""
    async for line in resp.content:
        if not line.endswith(b"\n"):
            raise ConnectionResetError("the body ended inside a line")
        if line.startswith(b"id:"):
            event_id = int(line[3:].strip() or 0)
            continue
        if line.startswith(b"event:"):
            name = line[6:].strip()
            continue
        if not line.startswith(b"data: "):
            continue
        if name == b"reconnect":
            h.reconnects += 1
            raise _Reconnect
        data = line[6:].strip()
        now = time.monotonic()
        if data == b"[DONE]":
            h.done = True
            return
        event = json.loads(data)
        code = _error_code(event)
        if code:
            h.error = code
            return
        piece = "".join((c.get("delta") or {}).get("content") or ""
                        for c in event.get("choices", ()))
        h.events.append((event_id, piece, now))
    raise _Lost


async def run_one(session: aiohttp.ClientSession, edges: list[str], first: int, h: History,
                  max_tokens: int, key: str, hang_after: float, model: str) -> None:
    """One resumable streaming chat; its history in ``h``."""
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": model, "stream": True, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": h.prompt}]}
    edge = first
    try:
        async with asyncio.timeout(hang_after):
            try:
                async with session.post(f"{edges[edge]}/v1/chat/completions", json=body,
                                        headers={**auth, **RESUMABLE}) as resp:
                    if resp.status != 200:
                        raw = await resp.read()
                        try:
                            h.error = _error_code(json.loads(raw)) or ""
                        except ValueError:
                            pass
                        if not h.error:
                            h.failure = f"HTTP {resp.status} without an OpenAI error body"
                        return
                    h.accepted = True
                    h.request_id = resp.headers.get("x-request-id", "")
                    await _consume(resp, h)
                    return
            except _Lost:
                h.failure = "ended without [DONE] or an error"
                return
            except (aiohttp.ClientError, ConnectionError, OSError, _Reconnect) as exc:
                if not (h.accepted and h.request_id):
                    h.error = f"connect:{type(exc).__name__}"  # nothing accepted: retryable
                    h.detail = str(exc)[:200]
                    return
            while True:  # resume, each time on the next edge
                h.resumes += 1
                edge = (edge + 1) % len(edges)
                last = max((i for i, _, _ in h.events), default=0)
                try:
                    async with session.get(f"{edges[edge]}/v1/streams/{h.request_id}",
                                           headers={**auth, "Last-Event-ID": str(last)}
                                           ) as resp:
                        if resp.status == 200:
                            try:
                                await _consume(resp, h)
                                return
                            except _Lost:
                                h.failure = "resumed body ended without [DONE] or an error"
                                return
                            except _Reconnect:
                                pass
                        raw = await resp.read()
                        if resp.status == 404:
                            h.failure = "stream_not_found on resume"
                            return
                        del raw
                except (aiohttp.ClientError, ConnectionError, OSError):
                    pass
                await asyncio.sleep(0.2)
    except TimeoutError:
        h.failure = f"no end within {hang_after:g}s"
    finally:
        h.ended = time.monotonic()


@dataclass
class Clients:
    """Closed-loop resumable streaming clients; every history kept."""

    edges: list[str]
    config: Config
    key: str
    concurrency: int = 8
    max_tokens: int = 48
    hang_after: float = 90.0
    histories: list[History] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=3.0)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(self._client(session, i, stop)
                                   for i in range(self.concurrency)))

    async def _client(self, session: aiohttp.ClientSession, i: int,
                      stop: asyncio.Event) -> None:
        n = 0
        model = self.config.models[0].name
        while not stop.is_set():
            prompt = f"netns client {i} request {n}"
            n += 1
            h = History(prompt, await expected_text(self.config, prompt, self.max_tokens),
                        time.monotonic())
            self.histories.append(h)
            await run_one(session, self.edges, i % len(self.edges), h, self.max_tokens,
                          self.key, self.hang_after, model)
            if not h.done:
                await asyncio.sleep(0.5)  # as Retry-After asks


def duplicated(h: History) -> int:
    """Tokens taken in twice or text over/under the expected (0 when exact)."""
    ids = [i for i, _, _ in h.events if i]
    dups = len(ids) - len(set(ids))
    if h.done and h.text != h.expected:
        dups += max(1, abs(len(h.text) - len(h.expected)))
    return dups


def check(histories: list[History], since: float = 0.0) -> dict[str, Any]:
    """The verdict over every history started at or after ``since``."""
    chosen = [h for h in histories if h.started >= since]
    kinds: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    lost: list[str] = []
    stalls: list[float] = []
    details: dict[str, str] = {}  # the first words of each connect error
    for h in chosen:
        if h.detail:
            details.setdefault(h.error, h.detail)
        if h.done and h.text == h.expected:
            kinds["complete"] += 1
            stalls.append(h.max_stall())
        elif h.error:
            kinds["clean_error"] += 1
            codes[h.error] += 1
        elif h.done:
            kinds["corrupt"] += 1
            lost.append(f"{h.request_id}: [DONE] after {len(h.text)}/{len(h.expected)} chars")
        else:
            kinds["lost"] += 1
            lost.append(f"{h.request_id or h.prompt}: {h.failure or 'unfinished'}")
    stalls.sort()

    def pct(p: float) -> float | None:
        return round(stalls[min(len(stalls) - 1, int(p * len(stalls)))], 3) if stalls else None

    return {"requests": len(chosen), "complete": kinds["complete"],
            "clean_errors": kinds["clean_error"], "error_codes": dict(codes),
            "lost": kinds["lost"] + kinds["corrupt"],
            "duplicated_tokens": sum(duplicated(h) for h in chosen),
            "resumed": sum(1 for h in chosen if h.resumes),
            "told_to_reconnect": sum(1 for h in chosen if h.reconnects),
            "accepted_not_complete": sum(1 for h in chosen if h.accepted
                                         and not (h.done and h.text == h.expected)),
            "stall_p50": pct(0.5), "stall_p99": pct(0.99),
            "stall_max": stalls[-1] if stalls else None, "lost_detail": lost[:10],
            **({"error_detail": details} if details else {})}
