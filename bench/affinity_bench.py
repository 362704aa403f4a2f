"""(f) affinity: cache-aware routing across replicas (docs/routing.md).

Four fake backends (two in ``chats40``) with the prefix-cache model serve one
model as replicas. ``chats`` conversations of ``turns`` turns run at once, a
pause (``think_s``) before each turn, every turn resending the conversation so
far. The run happens twice on fresh backends and stacks: ``routing.affinity =
"auto"`` and ``"off"``.

Reported per mode: later turns at their home, TTFT p50/p99, the share of prompt
characters cached, routing decisions by reason, and requests per replica over
the mean. Targets: docs/benchmarks.md#f-affinity-routing-across-four-replicas.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from fleet.run.servers import (
    ManagedProcess,
    NatsServer,
    RedisServer,
    free_port,
    http_ok,
    stop_all,
)
from tidegate import config as tgconfig

# think_s: a chat's mean pause before each turn (uniform in [0.5, 1.5] x it;
# the first turns spread over [0, 1] x it), as a user reads and types. With
# none, the chats are a closed loop that keeps the stack's CPU saturated: each
# turn then takes (chats / the stack's throughput), by Little's law, however
# long its prefill is (200 chats on 2 cores: 300 ms whether 70 % or 30 % of
# the prompt was cached), and the run measures the CPU, not the routing.
QUICK: dict[str, Any] = {"chats": 16, "turns": 3, "replicas": 4, "max_streams": 64,
                         "think_s": 0.1}
FULL: dict[str, Any] = {"chats": 200, "turns": 6, "replicas": 4, "max_streams": 64,
                        "think_s": 1.0}
SATURATED: dict[str, Any] = {**FULL, "think_s": 0.0}
# Issue 29's check of the routing rule: homes that fill up, with the default
# adaptive limit (`python -m bench.affinity_bench --profile chats40`).
CHATS40: dict[str, Any] = {"chats": 40, "turns": 5, "replicas": 2, "max_streams": "auto",
                           "think_s": 0.0}
PROFILES = {"quick": QUICK, "full": FULL, "saturated": SATURATED, "chats40": CHATS40}
MODEL = "bench-chat"
KEY = "sk-tg-bench-affinity"
_HOST = "127.0.0.1"
# 100 us per uncached character (about 0.4 ms per token): a 3,000-character
# conversation costs 300 ms of prefill, as an 8B model's long prompt does on
# one GPU under load, and a cached one almost nothing.
PREFILL_PER_CHAR = 100e-6
CACHE_BLOCKS = 1024  # 256 KiB of prompt per replica: the whole fleet's chats do not fit one


def _python(module: str, *args: str) -> list[str]:
    import sys

    return [sys.executable, "-m", module, *args]


def _chat(i: int, turn: int) -> list[dict[str, str]]:
    system = f"You are assistant {i}. " + "Answer in the voice of a patient teacher. " * 20
    messages = [{"role": "system", "content": system}]
    for t in range(turn + 1):
        messages.append({"role": "user", "content": f"Chat {i}, question {t}: " + "why? " * 30})
        if t < turn:
            messages.append({"role": "assistant", "content": f"Answer {t}. " + "because. " * 25})
    return messages


async def _turn(session: aiohttp.ClientSession, url: str, i: int, turn: int) -> float:
    # `user` names the chat for the fake backends' turn log (GET /fake/turns);
    # routing.key_user is off, so it is no part of the affinity key.
    body = {"model": MODEL, "stream": True, "max_tokens": 4, "messages": _chat(i, turn),
            "user": f"chat-{i}"}
    start = time.monotonic()
    async with session.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"turn {turn} of chat {i}: HTTP {resp.status}: "
                               f"{(await resp.read())[:200]!r}")
        first = None
        async for line in resp.content:
            if first is None and line.startswith(b"data: "):
                first = time.monotonic() - start
        return first if first is not None else time.monotonic() - start


def _at_home(fakes: list[str]) -> tuple[float | None, float | None]:
    """Of the later turns of every chat: the share served by the replica of
    the turn before (the one holding its cache), and by the replica of its
    first turn (issue 29's measure), from the fake backends' turn logs."""
    where: dict[str, dict[int, int]] = {}
    for r, url in enumerate(fakes):
        with urllib.request.urlopen(f"{url}/fake/turns", timeout=10) as resp:
            for chat, counts in json.loads(resp.read()).items():
                for n in counts:
                    where.setdefault(chat, {})[n] = r
    previous = first = later = 0
    for turns in where.values():
        order = [turns[n] for n in sorted(turns)]
        for i in range(1, len(order)):
            later += 1
            previous += order[i] == order[i - 1]
            first += order[i] == order[0]
    return ((round(previous / later, 3), round(first / later, 3)) if later
            else (None, None))


def _routes(url: str) -> dict[str, int]:
    """The dispatcher's routing decisions by reason (docs/routing.md)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("tidegate_affinity_routes") and "tidegate_route_reason=" in line:
            reason = line.split('tidegate_route_reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("fake_"):
            name, value = line.split()
            out[name] = float(value)
    return out


async def _mode(workdir: Path, affinity: str, profile: dict[str, Any]) -> dict[str, Any]:
    procs: list[ManagedProcess] = []
    tmp = Path(tempfile.mkdtemp(prefix=f"tidegate-affinity-{affinity}-"))
    logs = workdir / "logs"
    try:
        fakes = []
        for r in range(profile["replicas"]):
            port = free_port(_HOST)
            url = f"http://{_HOST}:{port}"
            fake = ManagedProcess(
                f"affinity-{affinity}-fake{r}",
                _python("bench.fake_backend", "--host", _HOST, "--port", str(port),
                        "--ttft", "0.005", "--itl", "0.002", "--report-load",
                        "--prefill-per-char", str(PREFILL_PER_CHAR),
                        "--cache-blocks", str(CACHE_BLOCKS)),
                logs / f"affinity-{affinity}-fake{r}.log",
                ready=functools.partial(http_ok, f"{url}/v1/models"), start_timeout=30.0)
            procs.append(fake)
            fake.start()
            fakes.append(url)
        nats = NatsServer(tmp / "nats", host=_HOST, log_path=logs / f"affinity-{affinity}-nats.log")
        redis = RedisServer(tmp / "redis", host=_HOST,
                            log_path=logs / f"affinity-{affinity}-redis.log")
        procs += [nats, redis]
        nats.start()
        redis.start()
        port = free_port(_HOST)
        config = tgconfig.from_dict({
            "nats": {"url": nats.url}, "redis": {"url": redis.url},
            "edge": {"host": _HOST, "port": port, "metrics_port": 0}, "auth": {"dev_key": KEY},
            "routing": {"affinity": affinity},
            "models": [{"name": MODEL, "backend": "openai",
                        "base_urls": [f"{u}/v1" for u in fakes],
                        "max_streams": profile["max_streams"]}]})
        path = workdir / f"affinity-{affinity}.toml"
        path.write_text(tgconfig.dump_toml(config))
        edge_url = f"http://{_HOST}:{port}"

        def edge_ready() -> bool:
            return http_ok(f"{edge_url}/readyz")

        dispatcher_metrics = free_port(_HOST)
        for tier in ("dispatcher", "worker", "edge"):
            env = ({**os.environ, "TIDEGATE_METRICS_PORT": str(dispatcher_metrics)}
                   if tier == "dispatcher" else None)
            proc = ManagedProcess(f"affinity-{affinity}-{tier}",
                                  _python("fleet", tier, "--config", str(path)),
                                  logs / f"affinity-{affinity}-{tier}.log",
                                  ready=edge_ready if tier == "edge" else None,
                                  start_timeout=30.0, env=env)
            procs.append(proc)
            proc.start()
        url = f"{edge_url}/v1/chat/completions"
        ttfts: list[float] = []
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=300)) as session:
            await _warm(session, url)
            before = [_scrape(u) for u in fakes]

            think = float(profile.get("think_s", 0.0))

            async def chat(i: int) -> None:
                rng = random.Random(i)  # the same pauses in both modes
                for turn in range(profile["turns"]):
                    if think:
                        await asyncio.sleep(think * (rng.random() if turn == 0
                                                     else rng.uniform(0.5, 1.5)))
                    ttfts.append(await _turn(session, url, i, turn))

            started = time.monotonic()
            await asyncio.gather(*(chat(i) for i in range(profile["chats"])))
            elapsed = time.monotonic() - started
        after = [_scrape(u) for u in fakes]
        served = [a["fake_requests_total"] - b["fake_requests_total"]
                  for a, b in zip(after, before, strict=True)]
        prompt = sum(a["fake_prompt_chars_total"] - b["fake_prompt_chars_total"]
                     for a, b in zip(after, before, strict=True))
        cached = sum(a["fake_cached_chars_total"] - b["fake_cached_chars_total"]
                     for a, b in zip(after, before, strict=True))
        # Turns that found their conversation's earlier turns cached, of the
        # turns after the first (the first of a chat has nothing to find).
        hits = sum(a["fake_cache_hits_total"] - b["fake_cache_hits_total"]
                   for a, b in zip(after, before, strict=True))
        later = profile["chats"] * (profile["turns"] - 1)
        mean = statistics.fmean(served)
        at_previous, at_first = _at_home(fakes)
        reasons = _routes(f"http://{_HOST}:{dispatcher_metrics}")
        q = statistics.quantiles(ttfts, n=100, method="inclusive")
        return {"affinity": affinity, "turns": len(ttfts), "seconds": round(elapsed, 2),
                "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                "ttft_p99_ms": round(q[98] * 1000, 1),
                "cached_share": round(cached / prompt, 3) if prompt else None,
                "later_turns_cached": round(hits / later, 3) if later else None,
                "later_turns_at_home": at_previous, "later_turns_at_first_home": at_first,
                "routes": reasons,
                "served_per_replica": served,
                "max_over_mean": round(max(served) / mean, 3) if mean else None}
    finally:
        stop_all(procs, 10.0)


async def _warm(session: aiohttp.ClientSession, url: str) -> None:
    """One request through, so every tier (and the load view) is up."""
    deadline = time.monotonic() + 30
    while True:
        try:
            body = {"model": MODEL, "max_tokens": 1,
                    "messages": [{"role": "user", "content": "warm up"}]}
            async with session.post(url, json=body,
                                    headers={"Authorization": f"Bearer {KEY}"}) as resp:
                await resp.read()
                if resp.status == 200:
                    await asyncio.sleep(1.0)  # a load report from every replica group
                    return
        except aiohttp.ClientError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the affinity stack did not serve within 30 s")
        await asyncio.sleep(0.2)


async def run(workdir: Path, quick: bool = False,
              profile: dict[str, Any] | None = None) -> dict[str, Any]:
    profile = profile or (QUICK if quick else FULL)
    on = await _mode(workdir, "auto", profile)
    off = await _mode(workdir, "off", profile)
    return {"profile": profile, "prefill_per_char_s": PREFILL_PER_CHAR,
            "cache_blocks": CACHE_BLOCKS, "on": on, "off": off,
            "p50_ratio": round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
            if off["ttft_p50_ms"] else None,
            "targets": {"p50_at_most_half": on["ttft_p50_ms"] <= off["ttft_p50_ms"] / 2,
                        "spread_within_1_3": (on["max_over_mean"] or 0) <= 1.3,
                        "p99_no_worse": on["ttft_p99_ms"] <= off["ttft_p99_ms"]}}


def markdown(f: dict[str, Any]) -> list[str]:
    p = f["profile"]
    lines = [f"{p['chats']} chats x {p['turns']} turns on {p['replicas']} replicas, "
             f"{p.get('think_s', 0)} s between turns on average, max_streams "
             f"{p.get('max_streams', 64)} "
             f"(prefill {f['prefill_per_char_s'] * 1e6:.0f} us per uncached char, "
             f"{f['cache_blocks']} blocks of cache each)", "",
             "| affinity | TTFT p50 | TTFT p99 | prompt cached | later turns at home "
             "(at turn 1's) | requests per replica | max / mean |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for mode in (f["on"], f["off"]):
        home, first = mode.get("later_turns_at_home"), mode.get("later_turns_at_first_home")
        lines.append(f"| {mode['affinity']} | {mode['ttft_p50_ms']} ms | {mode['ttft_p99_ms']} ms "
                     f"| {mode['cached_share']:.0%} "
                     f"| {'' if home is None else f'{home:.0%} ({first:.0%})'} "
                     f"| {mode['served_per_replica']} | {mode['max_over_mean']} |")
    t = f["targets"]
    lines += ["", f"p50 with / without: {f['p50_ratio']} (target <= 0.5: "
                  f"{'met' if t['p50_at_most_half'] else 'missed'}); spread "
                  f"{'met' if t['spread_within_1_3'] else 'missed'} (<= 1.3x); p99 "
                  f"{'met' if t['p99_no_worse'] else 'missed'} (no worse than off)."]
    return lines


def main() -> None:
    """``python -m bench.affinity_bench [--profile chats40] [--out DIR]``: this
    scenario alone, both modes, its JSON and table on stdout."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="chats40")
    parser.add_argument("--max-streams", help='override the profile\'s ("auto" or a number)')
    parser.add_argument("--out", type=Path, default=None, help="logs and configs (a temp dir)")
    args = parser.parse_args()
    profile = dict(PROFILES[args.profile])
    if args.max_streams:
        profile["max_streams"] = (args.max_streams if args.max_streams == "auto"
                                  else int(args.max_streams))
    out = args.out or Path(tempfile.mkdtemp(prefix="tidegate-affinity-"))
    result = asyncio.run(run(out, profile=profile))
    print(json.dumps(result, indent=1))
    print("\n".join(markdown(result)))


if __name__ == "__main__":
    main()
