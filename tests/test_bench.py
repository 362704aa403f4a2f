"""The benchmark suite: its pieces in-process, and ``tidegate bench --quick`` end to end.

No timing assertions: the numbers depend on the machine. These tests only
check that a run completes and writes what docs/benchmarks.md promises.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from bench import alternate, loadgen, procstats, runner, telemetry_bench
from bench.fake_backend import FakeBackend
from bench.profiling import summarize
from tidegate.errors import TidegateError


def test_wait_seconds_sees_processes_waiting_for_a_core() -> None:
    """More CPU-bound processes than cores: together they must have waited."""
    n = (os.cpu_count() or 1) + 1
    spin = "import time\nend = time.monotonic() + 0.6\nwhile time.monotonic() < end: pass"
    children = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(n)]
    try:
        window = procstats.CpuWindow({f"spin{i}": p.pid for i, p in enumerate(children)})
        window.start()
        time.sleep(0.4)
        window.stop()
    finally:
        for child in children:
            child.wait()
    assert window.waited is not None
    waited = [w for w in window.waited.values() if w is not None]
    assert len(waited) == n
    assert all(w >= 0 for w in waited)
    assert sum(waited) > 0.05  # n spinners on n - 1 cores: at least one waits
    assert procstats.wait_seconds(children[0].pid) is None  # gone


def test_parse_scenarios() -> None:
    assert runner.parse_scenarios("c, a") == "ac"
    assert runner.parse_scenarios("a,b,c,d,e") == "abcde"
    with pytest.raises(TidegateError):
        runner.parse_scenarios("a,x")
    # q and t run only when asked for: the default stays a..e
    assert runner.parse_scenarios("q,a") == "aq"
    assert runner.parse_scenarios("a,b,c,d,e,q,t") == "abcdeqt"
    assert runner.parse_scenarios("r") == "r"
    # Names, the letters' aliases, and both mixed.
    assert runner.parse_scenarios("overhead,cancel") == "ac"
    assert runner.parse_scenarios("Telemetry, slow-clients,b") == "bdt"
    assert set(runner.NAMES.values()) == set(runner.KNOWN_SCENARIOS)
    with pytest.raises(TidegateError, match="overhead"):
        runner.parse_scenarios("overheads")
    assert runner.BenchOptions(scenarios="ac").command().startswith(
        "tidegate bench --scenarios overhead,cancel ")
    assert "q" not in runner.SCENARIOS
    assert "t" not in runner.SCENARIOS


def test_telemetry_env_sets_only_the_variant() -> None:
    base = {"PATH": "/bin", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:4318",
            "OTEL_SDK_DISABLED": "false"}
    off = telemetry_bench.telemetry_env("off", "http://127.0.0.1:9", base)
    metrics = telemetry_bench.telemetry_env("metrics", "http://127.0.0.1:9", base)
    traced = telemetry_bench.telemetry_env("traced", "http://127.0.0.1:9", base)

    def otel(env: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if k.startswith("OTEL_")}

    assert otel(off) == {"OTEL_SDK_DISABLED": "true"}
    assert otel(metrics) == {}
    assert otel(traced) == {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9",
                            "OTEL_TRACES_SAMPLER": "always_on"}
    assert traced["PATH"] == "/bin"
    assert "127.0.0.1" in traced["NO_PROXY"]
    with pytest.raises(ValueError, match="variant"):
        telemetry_bench.telemetry_env("loud", "", base)


def test_telemetry_summary_deltas() -> None:
    def run(variant: str, us_chunk: float, ms_req: float) -> dict[str, object]:
        return {"variant": variant, "cpu_us_per_chunk": us_chunk, "cpu_ms_per_request": ms_req,
                "window_chunks": 1000, "streams_per_s": 10.0, "chunks_per_s": 600.0,
                "ttft_ms": {"p50": 50.0, "p99": 60.0}, "error_count": 0, "env_ok": True,
                "spans_per_request": 3.0 if variant == "traced" else 0.0,
                "cpu_s": {"edge": us_chunk / 2e3, "dispatcher": 0.0, "worker": us_chunk / 2e3,
                          "nats-server": 0.0, "otlp-sink": 0.1}}

    summary = telemetry_bench.telemetry_summary([run("off", 40, 2.0), run("metrics", 42, 2.1),
                                                 run("traced", 46, 2.4), run("traced", 48, 2.6)])
    assert summary["variants"]["traced"]["cpu_us_per_chunk"] == 47
    assert summary["variants"]["traced"]["rounds"] == 2
    assert summary["variants"]["off"]["process_us_per_chunk"]["edge"] == 20
    deltas = {(d["variant"], d["against"]): d for d in summary["deltas"]}
    assert deltas["metrics", "off"]["cpu_us_per_chunk"] == 2
    assert deltas["traced", "off"]["cpu_us_per_request"] == 500
    assert deltas["traced", "metrics"]["cpu_us_per_chunk_pct"] == pytest.approx(11.9)


async def test_closed_loop_and_cancel_against_the_fake() -> None:
    async with FakeBackend(ttft=0.0, itl=0.001) as fake:
        endpoint = loadgen.Endpoint("direct", fake.base_url, "m")
        rec = loadgen.Recorder()
        async with loadgen.new_session() as session:
            await loadgen.closed_loop(
                session, endpoint,
                lambda: loadgen.chat_body("m", tokens=5, itl=0.001, ttft=0.0),
                rec, concurrency=4, warmup=0.1, duration=0.3)
            summary = rec.summary()
            assert summary["error_count"] == 0
            assert summary["completed"] > 0
            assert summary["ttft_ms"]["count"] > 0
            # role chunk + 5 tokens + finish chunk per stream
            assert rec.chunks == 7 * rec.completed

            body = loadgen.chat_body("m", tokens=1000, itl=0.001, ttft=0.0, bench_id="x1")
            closed = await loadgen.stream_once(session, endpoint, body, rec, 0.0,
                                               cancel_after=3)
        assert closed is not None
    record = fake.records[-1]
    assert record.body["bench_id"] == "x1"
    assert record.closed_at is not None


async def test_closed_loop_streams_the_responses_api() -> None:
    async with FakeBackend(ttft=0.0, itl=0.001) as fake:
        endpoint = loadgen.Endpoint("direct", fake.base_url, "m", path="/responses")
        rec = loadgen.Recorder()
        async with loadgen.new_session() as session:
            await loadgen.closed_loop(
                session, endpoint,
                lambda: loadgen.responses_body("m", tokens=5, itl=0.001, ttft=0.0),
                rec, concurrency=4, warmup=0.1, duration=0.3)
        summary = rec.summary()
        assert summary["error_count"] == 0
        assert summary["completed"] > 0
        # 4 opening events + 5 deltas + 4 closing ones, the last response.completed
        assert rec.chunks == 13 * rec.completed
        assert all(r.path == "/v1/responses" for r in fake.records)


def test_py_spy_raw_summary(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "MainThread;Runner.run (asyncio/runners.py:118);"
        "run_service (fleet/run/runtime.py:40);_relay (edge/relay.py:9);"
        "write (edge/relay.py:10) 3\n"
        "MainThread;Runner.run (asyncio/runners.py:118);encode (tidegate/protocol.py:5) 1\n"
        "MainThread;Runner.run (asyncio/runners.py:118) 1\n")
    summary = summarize(raw)
    assert summary["samples"] == 5
    assert summary["self_pct"][0] == ["write (edge/relay.py)", 60.0]
    # the entry frames every sample shares are left out of the inclusive ranking
    assert summary["inclusive_pct"][0] == ["_relay (edge/relay.py)", 60.0]
    assert all("runners.py" not in name and "runtime.py" not in name
               for name, _ in summary["inclusive_pct"])
    assert ["tidegate edge/", 60.0] in summary["area_pct"]
    assert ["event loop (uvloop, C)", 20.0] in summary["area_pct"]


@pytest.mark.pipeline
def test_quick_bench_writes_results(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--out",
                           str(out)], capture_output=True, text=True, timeout=420, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert set(results) >= {"meta", "scenarios", "targets"}
    assert set(results["scenarios"]) == {"a", "b", "c", "d"}
    assert {"nproc", "cpu_model", "ram_gib"} <= set(results["meta"]["machine"])
    a = results["scenarios"]["a"]["runs"]
    assert {r["target"] for r in a} >= {"direct", "tidegate", "proxy", "floor"}
    # tidegate against the design's floor at every load (issue 48's ratios).
    assert all(r["over_floor"]["cpu_us_per_chunk"] for r in a if r["target"] == "tidegate"), a
    # Each concurrency twice: users spread over the warm-up, and all at once.
    assert {r.get("arrival") for r in a if r["mode"] == "closed"} == {"spread", "burst"}
    assert all("throughput_ratio" in r for r in a
               if r["target"] == "tidegate" and r["mode"] == "closed")
    for run in a:
        assert {"streams_per_s", "chunks_per_s", "ttft_ms", "itl_ms", "cpu_s",
                "runqueue_wait_s"} <= set(run)
        assert set(run["runqueue_wait_s"]) == set(run["cpu_s"])
    tidegate = [r for r in a if r["target"] == "tidegate"]
    assert all("cpu_us_per_chunk" in r and "ttft_overhead_ms" in r for r in tidegate)
    b = results["scenarios"]["b"]["runs"]
    assert {"edge", "worker"} <= set(next(r for r in b if r["target"] == "tidegate")
                                     ["rss_per_stream_kib"])
    assert all("latency_ms" in r for r in results["scenarios"]["c"]["runs"])
    assert all("rss_kib" in r for r in results["scenarios"]["d"]["runs"])
    # Every slow client was served (a request tidegate refuses measures nothing:
    # max_tokens past max_output_tokens once turned (d) into a row of 400s).
    assert all(r["statuses"] == ["HTTP/1.1 200 OK"] for r in results["scenarios"]["d"]["runs"]), \
        [r["statuses"] for r in results["scenarios"]["d"]["runs"]]
    # The targets docs/benchmarks.md documents ("Against the targets").
    assert [(row["key"], row["target"]) for row in results["targets"]] == [
        ("ttft_overhead_p99_ms", 20.0), ("throughput_ratio", 0.90), ("cpu_us_per_chunk", 50.0),
        ("rss_per_idle_stream_kib", 20.0), ("idle_streams_held", 10_000),
        ("cancel_p99_ms", 100.0)]
    assert "## Targets" in (out / "results.md").read_text()


@pytest.mark.pipeline
def test_quick_telemetry_scenario(tmp_path: Path) -> None:
    """Scenario t: three stacks, each with its own OTEL_* environment, and
    the effects show (no /metrics when off, spans only when traced)."""
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDEGATE_", "OTEL_"))}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "telemetry", "--out", str(out)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    t = results["scenarios"]["t"]
    runs = {r["variant"]: r for r in t["runs"]}
    assert set(runs) == {"off", "metrics", "traced"}
    assert all(r["env_ok"] and r["error_count"] == 0 and r["cpu_us_per_chunk"]
               for r in runs.values())
    assert runs["off"]["edge_metrics_bytes"] == 0
    assert runs["metrics"]["edge_metrics_bytes"] > 0
    assert runs["off"]["spans"] == runs["metrics"]["spans"] == 0
    assert set(runs["traced"]["spans_by_service"]) == {
        "tidegate-edge", "tidegate-dispatcher", "tidegate-worker"}
    assert {(d["variant"], d["against"]) for d in t["summary"]["deltas"]} == {
        ("metrics", "off"), ("traced", "off"), ("traced", "metrics")}
    assert "## (t) Telemetry overhead" in (out / "results.md").read_text()


@pytest.mark.pipeline
def test_quick_responses_scenario(tmp_path: Path) -> None:
    """Scenario r: chat, Responses and Messages streams (passed through and
    translated) on direct and tidegate, each API against its own direct run."""
    from bench.responses_bench import APIS

    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TIDEGATE_", "OTEL_"))}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "r", "--out", str(out)], capture_output=True, text=True,
                          timeout=480, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    r = results["scenarios"]["r"]
    assert {(run["api"], run["target"]) for run in r["runs"]} == {
        (api, target) for api in APIS for target in ("direct", "tidegate")}
    assert all(run["error_count"] == 0 and run["completed"] > 0 for run in r["runs"])
    for api in APIS:
        assert r["summary"][api]["cpu_us_per_chunk"] > 0
        assert "p99" in r["summary"][api]["ttft_overhead_ms"]
    assert "## (r) Responses and Messages API streaming overhead" in (
        out / "results.md").read_text()


@pytest.mark.pipeline
def test_quick_resumable_scenario(tmp_path: Path) -> None:
    """Scenario s: the default stack and a resumable one on the same load
    (resumable events carry ids, the load generator must count them as
    chunks), and explicit cancels that the backend sees as closes."""
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "s", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    s = json.loads((out / "results.json").read_text())["scenarios"]["s"]
    assert {(r["target"], r["arrival"]) for r in s["runs"]} == {
        (t, a) for t in ("direct", "tidegate", "resumable") for a in ("spread", "burst")}
    for run in s["runs"]:
        assert run["error_count"] == 0, run["errors"]
        assert run["window_completed"] > 0
    assert all(r["cpu_us_per_chunk"] > 0 for r in s["runs"] if r["target"] != "direct")
    cancel = s["cancel"]
    assert cancel["cancels"] == s["params"]["cancel_concurrency"]
    assert cancel["outcomes"]["closed"] == cancel["cancels"], cancel["outcomes"]
    assert "## (s) Resumable streams" in (out / "results.md").read_text()


@pytest.mark.pipeline
def test_quota_scenario_counts_round_trips(tmp_path: Path) -> None:
    from bench import quota

    profile = quota.QuotaProfile(name="test", runs=((1, 4, True), (2, 4, False)), warmup=0.2,
                                 duration=0.5, window=1.0)
    results = quota.run(tmp_path, profile=profile)
    one, two = results["runs"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert one["requests"] > 0
    assert two["requests"] > 0
    assert one["rejected"] == 0
    # reserve: one EVALSHA; reconcile: HGET + EVALSHA
    assert one["round_trips_per_request"]["reserve"] == pytest.approx(1.0, abs=0.02)
    assert one["round_trips_per_request"]["reconcile"] == pytest.approx(2.0, abs=0.02)
    assert two["round_trips_per_request"].get("reconcile", 0) == 0
    assert one["redis_calls_per_request"]["evalsha"] == pytest.approx(2.0, abs=0.05)
    assert one["admit_us"]["count"] == one["requests"]
    assert "## (q) Quota check cost" in "\n".join(quota.markdown(results))


def test_alternate_variants_parse_and_reject_clearly(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parents[1]
    tree = alternate.parse_variant(f"base=tree:{repo}")
    assert tree.name == "base"
    assert tree.env == {"PYTHONPATH": str(repo)}
    assert tree.cwd == repo
    one = alternate.parse_variant("one=env:GOMAXPROCS=1,TG_X=a=b")
    assert one.env == {"GOMAXPROCS": "1", "TG_X": "a=b"}
    assert one.environ()["GOMAXPROCS"] == "1"
    wide = alternate.parse_variant("wide=set:dispatcher.batch=256,worker.read_bytes=8192")
    assert wide.env == {}
    assert wide.settings == ("dispatcher.batch=256", "worker.read_bytes=8192")
    assert alternate.parse_variant("plain=proxy").peer == "proxy"
    assert alternate.parse_variant("min=floor").peer == "floor"
    for bad in ("base", "base=", "base=tree:", "x=sh:ls", "y=env:NOEQUALS",
                f"z=tree:{tmp_path}", "w=set:nodot"):
        with pytest.raises(TidegateError):
            alternate.parse_variant(bad)


def test_a_tree_variant_runs_in_its_tree(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    """``python -m`` puts the working directory before PYTHONPATH: a tree's
    child run from another checkout measured that checkout's code (every
    tree A/B run from the repo measured the repo twice). Its processes run
    in the tree."""
    tree = tmp_path / "tree"
    (tree / "tidegate").mkdir(parents=True)
    (tree / "tidegate" / "__init__.py").write_text("")
    calls: list[dict[str, Any]] = []

    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        calls.append(kwargs)
        return subprocess.CompletedProcess(argv, 1, "", "stopped here")

    monkeypatch.setattr(alternate.subprocess, "run", run)
    alternate.main(["--rounds", "1", f"t=tree:{tree}"])
    alternate.main(["--rounds", "1", "e=env:X=1"])
    assert calls[0]["cwd"] == tree
    assert calls[0]["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    assert calls[1]["cwd"] is None  # other variants run where the command was started


def test_alternate_runs_a_variant_end_to_end() -> None:
    """A real (tiny) round: a fresh stack in a child process whose tiers come
    from the named tree, and a line of CPU per chunk for it."""
    repo = Path(__file__).resolve().parents[1]
    # A 3 s window: on a loaded machine a 0.8 s one saw no stream end in it
    # ("relayed nothing in the window", a full suite beside other work).
    done = subprocess.run(
        [sys.executable, "-m", "bench.alternate", "--rounds", "1",
         "--concurrency", "5", "--window", "3", "--warmup", "0.3", f"here=tree:{repo}",
         "small=set:worker.read_bytes=4096", "plain=proxy"],
        capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("here", "small", "plain"):
        lines = [line for line in done.stdout.splitlines() if line.strip().startswith(name)]
        assert len(lines) == 1, done.stdout
        assert float(lines[0].split()[1]) > 0  # µs of CPU per chunk, summed over the tiers


@pytest.mark.pipeline
def test_quick_websocket_scenario(tmp_path: Path) -> None:
    """Scenario w, tiny: sockets x generations over the WebSocket protocol, the
    same load over SSE, idle sockets' RSS, and cancel frames seen by the backend."""
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "w", "--out", str(out)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    w = json.loads((out / "results.json").read_text())["scenarios"]["w"]
    ws_run, sse_run = w["runs"]
    assert ws_run["transport"] == "websocket"
    assert sse_run["transport"] == "sse"
    for run in (ws_run, sse_run):
        assert run["error_count"] == 0, run["errors"]
        assert run["window_completed"] > 0
        assert run["ttft_ms"]["count"] > 0
    assert w["idle"]["open_ok"] == w["params"]["idle_sockets"]
    assert w["idle"]["still_open"] == w["idle"]["open_ok"]
    assert w["idle"]["failures"] == {}
    assert w["idle"]["target"] == "ws-idle"  # a fresh stack, not the loaded one
    assert w["idle"]["rss_per_socket_kib"]["edge"] is not None
    cancel = w["cancel"]
    assert cancel["cancels"] == w["params"]["cancel_sockets"] * w["params"]["per_socket"]
    assert cancel["closed"] == cancel["cancels"]
    assert "## (w) WebSocket against SSE" in (out / "results.md").read_text()


async def test_fake_saturation_slows_every_stream_past_k() -> None:
    """saturate_at=2: 2 streams keep the configured pace, 6 at once take
    about 3x as long each (N / K), and the pace recovers once they are done."""
    async def one(session: aiohttp.ClientSession, url: str) -> float:
        started = time.monotonic()
        async with session.post(f"{url}/chat/completions", json={
                "model": "m", "stream": True, "max_tokens": 20,
                "messages": [{"role": "user", "content": "x"}]}) as resp:
            assert resp.status == 200
            body = await resp.read()
        assert body.endswith(b"data: [DONE]\n\n")
        return time.monotonic() - started

    async with FakeBackend(ttft=0.02, itl=0.01, saturate_at=2) as fake, \
            aiohttp.ClientSession() as session:
        paced = await asyncio.gather(*(one(session, fake.base_url) for _ in range(2)))
        crowded = await asyncio.gather(*(one(session, fake.base_url) for _ in range(6)))
        again = await one(session, fake.base_url)
        assert fake.peak_active == 6
        assert fake.active == 0
        assert all(r.first_byte_at is not None for r in fake.records)
    uncongested = 0.02 + 20 * 0.01
    assert max(paced) < 2 * uncongested
    # 3x slower while all six run; at least 2x on a loaded machine's timers.
    assert min(crowded) > 2 * min(paced)
    assert again < 2 * uncongested


@pytest.mark.pipeline
def test_the_floor_relays_every_chunk_through_jetstream(tmp_path: Path) -> None:
    """bench.floor as `tidegate bench` starts it (its own nats-server): every
    stream of a closed loop completes with all its chunks, so the floor's CPU
    per chunk is the cost of whole streams, not of failed ones."""
    from bench.targets import MODEL, Targets

    with Targets(tmp_path) as env:
        env.start_fake()
        target = env.start_floor()

        async def drive() -> loadgen.Recorder:
            rec = loadgen.Recorder()
            async with loadgen.new_session() as session:
                await loadgen.closed_loop(
                    session, target.endpoint,
                    lambda: loadgen.chat_body(MODEL, tokens=300, itl=0.001, ttft=0.0),
                    rec, concurrency=6, warmup=0.2, duration=1.5)
                # Idle past the worker's 1 s pull: it still serves (a pull's
                # timeout is the idle worker's normal case).
                before = rec.completed
                # 300 tokens: past the floor's flow-control window (256
                # frames) unless its acks come back; data events counted whole.
                assert rec.chunks >= 300 * before, rec.summary()
                await asyncio.sleep(2.5)
                await loadgen.stream_once(session, target.endpoint, loadgen.chat_body(
                    MODEL, tokens=3, itl=0.001, ttft=0.0), rec, 0.0)
                assert rec.completed == before + 1, rec.summary()
            return rec

        rec = asyncio.run(drive())
    summary = rec.summary()
    assert summary["error_count"] == 0, summary
    assert rec.completed > 1


@pytest.mark.pipeline
@pytest.mark.parametrize("peer", ["fastapi", "litellm"])
def test_bench_peer_relays_streams_and_cancels(tmp_path: Path, peer: str) -> None:
    """A tiny run through each optional peer as `tidegate bench` starts it
    (skipped without the `peers` extra): streams complete with every chunk,
    and a client that leaves makes the peer close the backend connection."""
    from bench.targets import MODEL, Targets

    pytest.importorskip("fastapi" if peer == "fastapi" else "litellm")
    with Targets(tmp_path, heartbeat_interval=2.0, max_streams=64) as env:
        env.start_fake()
        target = env.start_fastapi() if peer == "fastapi" else env.start_litellm()
        assert target is not None, env.notes

        async def drive() -> tuple[loadgen.Recorder, Any]:
            rec = loadgen.Recorder()
            async with loadgen.new_session() as session:
                await loadgen.closed_loop(
                    session, target.endpoint,
                    lambda: loadgen.chat_body(MODEL, tokens=5, itl=0.002, ttft=0.0),
                    rec, concurrency=4, warmup=0.2, duration=1.0)
                body = loadgen.chat_body(MODEL, tokens=2000, itl=0.005, ttft=0.0,
                                         bench_id=f"cancel-{peer}")
                closed = await loadgen.stream_once(session, target.endpoint, body, rec, 0.0,
                                                   cancel_after=3)
            return rec, closed

        rec, closed = asyncio.run(drive())
        summary = rec.summary()
        assert summary["error_count"] == 0, summary
        assert summary["completed"] > 0
        assert closed is not None
        deadline = time.monotonic() + 10
        record: dict[str, Any] = {}
        while time.monotonic() < deadline:
            record = next((r for r in env.records() if r.get("bench_id") == f"cancel-{peer}"),
                          {})
            if record.get("closed_at"):
                break
            time.sleep(0.1)
        assert record.get("closed_at"), record


@pytest.mark.pipeline
def test_quick_affinity_scenario(tmp_path: Path) -> None:
    """Scenario f: four fake replicas with a prefix cache, routing on and off.
    With affinity the replicas find far more of each prompt cached (the
    effect the TTFT target rests on), and every turn of every chat ran."""
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "f", "--out", str(out)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    f = json.loads((out / "results.json").read_text())["scenarios"]["f"]
    chats, turns = f["profile"]["chats"], f["profile"]["turns"]
    for mode in (f["on"], f["off"]):
        assert mode["turns"] == chats * turns
        assert sum(mode["served_per_replica"]) == chats * turns
    # With routing, every turn after the first hits its home's cache: 16 chats
    # x 3 turns cache about half of all prompt characters; without, a turn
    # reaches a replica that saw its chat about one time in four.
    assert f["on"]["cached_share"] > 0.45
    assert f["on"]["cached_share"] > 1.5 * f["off"]["cached_share"]
    assert "(f) affinity" in (out / "results.md").read_text()
