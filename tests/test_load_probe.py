"""A backend's own load report (workers/backends/load_probe.py): parsing, and
polling a real HTTP server."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from tests.pipeline import serve_app
from workers.backends.load_probe import (
    BackendLoad,
    LoadProbe,
    parse_llamacpp_slots,
    parse_vllm_metrics,
)

VLLM = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.42
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0 1700000000000
vllm:num_requests_running{engine="0",model_name="llama"} 7.0
process_cpu_seconds_total 12.5
"""


def test_vllm_metrics() -> None:
    assert parse_vllm_metrics(VLLM) == BackendLoad(0.42, 3)
    old = "vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.9\n"
    assert parse_vllm_metrics(old) == BackendLoad(0.9, None)
    assert parse_vllm_metrics("vllm:kv_cache_usage_perc 7\n").kv_usage == 1.0  # clamped
    assert parse_vllm_metrics("process_cpu_seconds_total 1\nvllm:x{a=\"}\"} nope\n") == \
        BackendLoad()


def test_llamacpp_slots() -> None:
    two = b'[{"id":0,"is_processing":true},{"id":1,"is_processing":false}]'
    assert parse_llamacpp_slots(two) == BackendLoad(None, 0)
    assert parse_llamacpp_slots(b'[{"id":0,"is_processing":true}]') == BackendLoad(None, 1)
    assert parse_llamacpp_slots(b"[]") == BackendLoad()
    with pytest.raises(ValueError, match="Expecting value"):
        parse_llamacpp_slots(b"not json")


async def test_probe_polls_vllm_and_gives_up_where_nothing_answers() -> None:
    hits: list[str] = []

    async def metrics(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(text=VLLM)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    async with serve_app(app) as url:
        probe = LoadProbe(f"{url}/v1")
        task = asyncio.create_task(probe.run())
        for _ in range(200):
            if probe.load.kv_usage is not None:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        assert probe.load == BackendLoad(0.42, 3)
        assert hits
        assert set(hits) == {"/metrics"}

    async with serve_app(web.Application()) as url:  # 404 everywhere: like Ollama
        await asyncio.wait_for(LoadProbe(f"{url}/v1").run(), timeout=10)


def test_idle_only_while_a_fresh_report_says_nothing_waits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [100.0]
    monkeypatch.setattr("workers.backends.load_probe.time.monotonic", lambda: now[0])
    probe = LoadProbe("http://replica:8000/v1")
    assert not probe.idle()  # nothing reported yet
    probe._set(BackendLoad(0.4, 0))
    assert probe.idle()
    probe._set(BackendLoad(0.4, 2))
    assert not probe.idle()  # requests wait in it
    probe._set(BackendLoad(0.4, 0))
    now[0] += 3.5  # three polls missed: the backend stopped answering
    assert not probe.idle()
    probe._set(BackendLoad(0.4, None))  # a backend that reports no queue
    assert not probe.idle()
