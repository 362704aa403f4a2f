"""A soak: mixed traffic on ``tidegate up --workers 2`` for an hour, a worker
SIGKILLed every 5 minutes (issue 43 item 6; docs/reliability.md, "Soak").

    python -m bench.soak [--duration 3600] [--rate 12] [--warmup S] [--retention S] [--out DIR]

``--rate`` requests a second on the shipped defaults (the simulator): chat SSE
and JSON, Responses SSE, WebSocket chat, resumable streams left and resumed,
streams cancelled by their client, a 2 MiB prompt, 5 % hostile requests (each
must get its 4xx), a five-line batch a minute; one with no outcome within 120 s
is *lost*. RSS sampled every 10 s; at the end each process's RSS slope after
warm-up (% of its mean per hour), consumers and claimed bodies left, an SVG.
``--retention S`` (not a default; in the report) keeps usage records, stored
responses and batch files S s, so nats-server's store levels off in the warm-up.
Exits 1 on a lost or failed request, a leak, or a slope over ``--max-slope``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from websockets.asyncio.client import connect as ws_connect

from fleet.run.servers import free_port

MODEL = "tidegate-sim"
KEY = "tg-soak-5e3f0c2d9a7b4e61"  # the dev key the stack is given
# What --retention shortens: the stores that grow with traffic until their age.
RETAINED = ("streams.usage_max_age", "streams.responses_max_age", "batch.file_ttl")
TIMEOUT = 120.0  # a request with no outcome by then is lost
MIX = (("chat_sse", 36), ("chat_json", 10), ("responses_sse", 15), ("ws", 10),
       ("resume", 10), ("cancel", 10), ("hostile", 5), ("large", 4))
ROLES = ("edge", "dispatcher", "worker", "nats-server", "redis-server")


# -- the stack -------------------------------------------------------------------


class Stack:
    """``tidegate up --workers 2`` as a subprocess, and its processes."""

    def __init__(self, workdir: Path, retention: float | None = None) -> None:
        self.port, self.monitor = free_port(), free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
        env["TIDEGATE_DEV_KEY"] = KEY
        if retention is not None:
            for key in RETAINED:
                env[f"TIDEGATE__{key.replace('.', '__').upper()}"] = repr(retention)
        self.out = workdir / "up.out"
        with open(self.out, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet", "up", "--workers", "2", "--port",
                 str(self.port), "--data-dir", str(workdir / "data"), "--console-port", "0",
                 "--nats-monitor-port", str(self.monitor)],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, within: float = 120.0) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if re.search(r"URL:\s+http://", self.out.read_text()):
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"tidegate up exited:\n{self.out.read_text()[-3000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"tidegate up not ready within {within:g}s")

    def processes(self) -> dict[str, int]:
        """role -> pid; workers as ``worker:<metrics port>``, the slot a
        restarted worker keeps."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    stat = (entry / "stat").read_text()
                except OSError:
                    continue
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
        found: dict[str, int] = {}
        todo = list(children.get(self.proc.pid, ()))
        while todo:
            pid = todo.pop()
            todo += children.get(pid, ())
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv if a]
            role = _role(words)
            if role == "worker":
                port = re.search(rb"TIDEGATE_METRICS_PORT=(\d+)",
                                 Path(f"/proc/{pid}/environ").read_bytes())
                role = f"worker:{port[1].decode() if port else pid}"
            if role is not None:
                found[role] = pid
        return found

    def jetstream(self) -> dict[str, dict[str, int]]:
        """stream -> {messages, consumers}, from the embedded NATS's monitor."""
        url = f"http://127.0.0.1:{self.monitor}/jsz?accounts=true&streams=true"
        with urllib.request.urlopen(url, timeout=10) as resp:
            data = json.load(resp)
        out: dict[str, dict[str, int]] = {}
        for account in data.get("account_details") or []:
            for stream in account.get("stream_detail") or []:
                state = stream.get("state", {})
                out[stream["name"]] = {"messages": int(state.get("messages", 0)),
                                       "consumers": int(state.get("consumer_count", 0))}
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _role(words: list[str]) -> str | None:
    """A tier (``python -m fleet <tier>``) or a server (by its program
    name; redis-server rewrites its command line to "redis-server host:port")."""
    if "fleet" in words[:3] and len(words) > words.index("fleet") + 1:
        tier = words[words.index("fleet") + 1]
        return tier if tier in ROLES else None
    program = Path(words[0].split(" ")[0]).name if words else ""
    return program if program in ("nats-server", "redis-server") else None


# -- the clients -----------------------------------------------------------------


def _chat(stream: bool, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "stream": stream, "max_tokens": 24,
            "messages": [{"role": "user", "content": text}], **extra}


class Clients:
    """One kind of request each; every call returns its outcome."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.auth = {"Authorization": f"Bearer {KEY}"}

    async def _sse(self, path: str, body: dict[str, Any], ends: tuple[bytes, ...],
                   headers: dict[str, str] | None = None) -> str:
        async with self.session.post(self.url + path, json=body,
                                     headers={**self.auth, **(headers or {})}) as resp:
            raw = await resp.read()
        if resp.status != 200:
            return f"error:http_{resp.status}"
        if any(end in raw for end in ends):
            return "ok"
        found = re.search(rb'"code":\s*"([a-z_]+)"', raw)
        return f"error:{found[1].decode() if found else 'no_end'}"

    async def chat_sse(self, n: int) -> str:
        return await self._sse("/v1/chat/completions", _chat(True, f"soak {n}"), (b"[DONE]",))

    async def chat_json(self, n: int) -> str:
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=_chat(False, f"soak {n}"), headers=self.auth) as resp:
            data = await resp.json(content_type=None)
        if resp.status != 200:
            return f"error:{(data.get('error') or {}).get('code') or resp.status}"
        return "ok" if data["choices"][0]["message"]["content"] else "error:empty"

    async def responses_sse(self, n: int) -> str:
        body = {"model": MODEL, "stream": True, "max_output_tokens": 24,
                "input": f"soak {n}"}
        # 24 tokens of the simulator's 64: the end is response.incomplete
        return await self._sse("/v1/responses", body,
                               (b"event: response.completed", b"event: response.incomplete"))

    async def large(self, n: int) -> str:
        text = f"soak {n} " + "lorem ipsum " * ((2 << 20) // 12)  # 2 MiB: a claimed body
        return await self._sse("/v1/chat/completions", _chat(True, text), (b"[DONE]",))

    async def ws(self, n: int) -> str:
        url = "ws" + self.url[4:] + "/v1/ws"
        async with ws_connect(url, additional_headers=self.auth) as sock:
            await sock.send(json.dumps({"type": "request", "id": "g1",
                                        "path": "/v1/chat/completions",
                                        "body": _chat(True, f"soak {n}")}))
            async for raw in sock:
                frame = json.loads(raw)
                if frame.get("type") == "done":
                    return "ok"
                if frame.get("type") == "error":
                    return f"error:{frame['error'].get('code')}"
        return "error:socket_closed"

    async def resume(self, n: int) -> str:
        """A resumable stream left after three events, read again from there."""
        headers = {**self.auth, "X-Tidegate-Resumable": "true"}
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=_chat(True, f"soak {n}"), headers=headers) as resp:
            if resp.status != 200:
                return f"error:http_{resp.status}"
            request_id = resp.headers["x-request-id"]
            seen, buf = 0, b""
            async for data in resp.content.iter_any():
                buf += data
                seen = len(re.findall(rb"^id: (\d+)", buf, re.M))
                if seen >= 3 or b"[DONE]" in buf:
                    break
        last = re.findall(rb"^id: (\d+)", buf, re.M)
        after = last[-1].decode() if last else "0"
        async with self.session.get(f"{self.url}/v1/streams/{request_id}",
                                    headers={**self.auth, "Last-Event-ID": after}) as again:
            raw = await again.read()
        if again.status != 200:
            return f"error:resume_{again.status}"
        return "ok" if b"[DONE]" in raw or b"[DONE]" in buf else "error:resume_no_end"

    async def cancel(self, n: int) -> str:
        """A client that leaves after two events."""
        async with self.session.post(self.url + "/v1/chat/completions",
                                     json=_chat(True, f"soak {n}"), headers=self.auth) as resp:
            if resp.status != 200:
                return f"error:http_{resp.status}"
            events = 0
            async for data in resp.content.iter_any():
                events += data.count(b"\n\n")
                if events >= 2:
                    break
        return "cancelled"

    async def hostile(self, n: int) -> str:
        """Bad input: each must get its own 4xx, never a 5xx or a 200."""
        kind = n % 4
        url = self.url + "/v1/chat/completions"
        if kind == 0:
            call = self.session.post(url, data=b'{"model": "tidegate-sim", "messages": [',
                                     headers={**self.auth, "Content-Type": "application/json"})
        elif kind == 1:
            call = self.session.post(url, json=_chat(False, "x"),
                                     headers={"Authorization": "Bearer tg-wrong"})
        elif kind == 2:
            call = self.session.post(url, json={**_chat(False, "x"), "model": "nope"},
                                     headers=self.auth)
        else:
            call = self.session.post(url, json={**_chat(False, "x"), "max_tokens": -5},
                                     headers=self.auth)
        async with call as resp:
            await resp.read()
        return "refused" if 400 <= resp.status < 500 else f"error:hostile_{resp.status}"

    async def batch(self, n: int) -> str:
        lines = b"".join(json.dumps({"custom_id": f"l{i}", "method": "POST",
                                     "url": "/v1/chat/completions",
                                     "body": _chat(False, f"batch {n} {i}")}).encode() + b"\n"
                         for i in range(5))
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", io.BytesIO(lines), filename="soak.jsonl")
        async with self.session.post(self.url + "/v1/files", data=form,
                                     headers=self.auth) as resp:
            file = await resp.json()
        async with self.session.post(self.url + "/v1/batches", headers=self.auth, json={
                "input_file_id": file["id"], "endpoint": "/v1/chat/completions",
                "completion_window": "24h"}) as resp:
            batch = await resp.json()
        while batch.get("status") not in ("completed", "failed", "expired", "cancelled"):
            await asyncio.sleep(2.0)
            async with self.session.get(f"{self.url}/v1/batches/{batch['id']}",
                                        headers=self.auth) as resp:
                batch = await resp.json()
        counts = batch.get("request_counts") or {}
        return "ok" if batch["status"] == "completed" and counts.get("completed") == 5 \
            else f"error:batch_{batch['status']}"


async def _outcome(call: Awaitable[str]) -> str:
    try:
        return await asyncio.wait_for(call, TIMEOUT)
    except TimeoutError:
        return "lost"
    except Exception as exc:  # a connection refused or reset: no answer at all
        return f"error:{type(exc).__name__}"


# -- the run -----------------------------------------------------------------------


async def traffic(stack: Stack, duration: float, rate: float, kill_every: float,
                  samples: list[tuple[float, str, int, int]],
                  consumers: list[tuple[float, int]]) -> dict[str, Counter[str]]:
    outcomes: dict[str, Counter[str]] = {}
    pending: set[asyncio.Task[None]] = set()
    rng = random.Random(7)
    kinds = [k for k, w in MIX for _ in range(w)]
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT)) as session:
        clients = Clients(session, stack.url)

        def launch(kind: str, n: int) -> None:
            call: Callable[[int], Awaitable[str]] = getattr(clients, kind)

            async def one() -> None:
                outcomes.setdefault(kind, Counter())[await _outcome(call(n))] += 1
            task = asyncio.ensure_future(one())
            pending.add(task)
            task.add_done_callback(pending.discard)

        n = 0
        next_kill, next_sample, next_batch = start + kill_every, start, start + 5.0
        victim = ""
        while (now := time.monotonic()) < start + duration:
            if now >= next_sample:
                for role, pid in stack.processes().items():
                    rss = _rss_kib(pid)
                    if rss:
                        samples.append((now - start, role, pid, rss))
                with contextlib.suppress(Exception):
                    counts = await asyncio.to_thread(stack.jetstream)
                    consumers.append((now - start, sum(s["consumers"] for s in counts.values())))
                next_sample += 10.0
            if now >= next_kill:
                workers = sorted(r for r in stack.processes() if r.startswith("worker:"))
                victim = victim or (workers[0] if workers else "")
                target = stack.processes().get(victim)
                if target:
                    os.kill(target, signal.SIGKILL)
                    print(f"[{now - start:7.1f}s] killed {victim} (pid {target})", flush=True)
                next_kill += kill_every
            if now >= next_batch:
                launch("batch", n)
                next_batch += 60.0
            launch(rng.choice(kinds), n)
            n += 1
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*pending, return_exceptions=True)
    return outcomes


def _rss_kib(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmRSS:\s+(\d+)", status)
    return int(found[1]) if found else 0


def slopes(samples: list[tuple[float, str, int, int]], warmup: float) -> dict[str, Any]:
    """Per role: for a process that lived from the warm-up to the end, the
    least-squares slope of its RSS as % of its mean per hour; for one that
    was restarted, its number of lives."""
    out: dict[str, Any] = {}
    for role in sorted({s[1] for s in samples}):
        mine = [s for s in samples if s[1] == role]
        pids = {s[2] for s in mine}
        late = [(t, rss) for t, _, pid, rss in mine if t >= warmup]
        if len(pids) > 1 or len(late) < 3:
            out[role] = {"lives": len(pids)}
            continue
        n = len(late)
        mt = sum(t for t, _ in late) / n
        mr = sum(r for _, r in late) / n
        slope = (sum((t - mt) * (r - mr) for t, r in late)
                 / (sum((t - mt) ** 2 for t, _ in late) or 1.0))
        out[role] = {"mean_mib": round(mr / 1024, 1),
                     "slope_pct_per_hour": round(slope * 3600 / mr * 100, 2)}
    return out


# JetStream consumers the run may end with above its start: a killed worker's
# watchers stay until the server reaps them (nats-py's 5 minutes), about five
# per kill; a consumer per request (a leak) is hundreds.
CONSUMER_SLACK = 12


def consumer_growth(series: list[tuple[float, int]], warmup: float) -> int:
    """How many more consumers the last third of the run held than the
    first third after warm-up (the most of each)."""
    late = [c for t, c in series if t >= warmup]
    if len(late) < 3:
        return 0
    third = max(1, len(late) // 3)
    return max(late[-third:]) - max(late[:third])


def plot(samples: list[tuple[float, str, int, int]], path: Path) -> None:
    """RSS over time per role, as a small SVG."""
    width, height, pad = 720, 360, 40
    tmax = max((s[0] for s in samples), default=1.0) or 1.0
    rmax = max((s[3] for s in samples), default=1) / 1024 * 1.1
    colours = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"]
    lines = []
    for i, role in enumerate(sorted({s[1] for s in samples})):
        points = " ".join(
            f"{pad + t / tmax * (width - 2 * pad):.1f},"
            f"{height - pad - rss / 1024 / rmax * (height - 2 * pad):.1f}"
            for t, r, _, rss in samples if r == role)
        colour = colours[i % len(colours)]
        lines.append(f'<polyline fill="none" stroke="{colour}" points="{points}"/>'
                     f'<text x="{width - pad + 4}" y="{pad + 14 * i}" fill="{colour}" '
                     f'font-size="10">{role}</text>')
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 80}" height="{height}">'
        f'<text x="{pad}" y="20" font-size="12">RSS (MiB, top {rmax:.0f}) over '
        f'{tmax / 60:.0f} min</text>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        f'stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" '
        f'stroke="black"/>{"".join(lines)}</svg>\n')


def run(duration: float, kill_every: float, rate: float, out: Path,
        max_slope: float, warmup: float | None = None,
        retention: float | None = None) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    stack = Stack(out, retention)
    samples: list[tuple[float, str, int, int]] = []
    consumers: list[tuple[float, int]] = []
    try:
        stack.wait_ready()
        outcomes = asyncio.run(traffic(stack, duration, rate, kill_every, samples, consumers))
        time.sleep(20.0)  # the last jobs' ends, reapers and deletes
        after = stack.jetstream()
    finally:
        stack.stop()
    # The slope is read after the warm-up: past the hour-long retentions
    # (streams.max_age, recent cancels) a process's memory should be flat.
    warmup = max(60.0, duration / 10) if warmup is None else warmup
    rss = slopes(samples, warmup)
    growth = consumer_growth(consumers, warmup)
    bodies = {name: s["messages"] for name, s in after.items()
              if name.endswith("_BODIES") and s["messages"]}
    total = Counter[str]()
    for counts in outcomes.values():
        total.update(counts)
    failed = {k: v for k, v in total.items() if k not in ("ok", "cancelled", "refused")}
    steep = {r: v for r, v in rss.items() if v.get("slope_pct_per_hour", 0) > max_slope}
    plot(samples, out / "soak-rss.svg")
    report = {"duration_s": duration, "kill_every_s": kill_every, "rate": rate,
              "retention_s": {key: retention for key in RETAINED} if retention else None,
              "requests": sum(total.values()),
              "outcomes": {k: dict(v) for k, v in sorted(outcomes.items())},
              "failed": failed, "rss": rss, "warmup_s": warmup,
              "consumers": {"growth": growth, "series": consumers}, "bodies_left": bodies,
              "streams_after": after,
              "ok": not failed and not steep and growth <= CONSUMER_SLACK and not bodies}
    (out / "soak.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=3600.0)
    parser.add_argument("--kill-every", type=float, default=300.0)
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second")
    parser.add_argument("--max-slope", type=float, default=1.0,
                        help="RSS % of its mean per hour a long-lived process may grow")
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds before the slopes are read (default: a tenth, >= 60)")
    parser.add_argument("--retention", type=float, default=None,
                        help="seconds usage records, responses and batch files are kept "
                             "(default: the shipped 24 h and 30 days)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="tidegate-soak-"))
    report = run(args.duration, args.kill_every, args.rate, out, args.max_slope, args.warmup,
                 args.retention)
    print(json.dumps({k: v for k, v in report.items() if k != "streams_after"}, indent=2))
    print(f"report: {out / 'soak.json'}, plot: {out / 'soak-rss.svg'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
