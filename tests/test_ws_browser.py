"""A real browser on the WebSocket ingress: headless Chromium loads a page the
test serves, authenticates with the first message (a browser cannot set
headers), runs two generations at once, cancels one, and writes what it saw
into the page; the test reads it over the DevTools protocol (CDP, spoken with
the ``websockets`` client). Skips, saying why, where Chromium is absent."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from websockets.asyncio.client import connect as ws_connect

from bench.fake_backend import FakeBackend
from tests.pipeline import DEV_KEY, Pipeline, record_for, serve_app, threaded_fake_backend, wait_for

pytestmark = pytest.mark.pipeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>tidegate ws test</title></head>
<body><pre id="result"></pre>
<script>
const out = {frames: {}, text: {}, closed: null};
const ws = new WebSocket(%(url)s);
function finish() { document.getElementById("result").textContent = JSON.stringify(out); }
ws.onopen = () => {
  ws.send(JSON.stringify({type: "auth", key: %(key)s}));
  ws.send(JSON.stringify({type: "request", id: "reply", path: "/v1/chat/completions",
    body: {model: "sim", max_tokens: 20,
           messages: [{role: "user", content: "hello from a browser"}]}}));
  ws.send(JSON.stringify({type: "request", id: "long", path: "/v1/chat/completions",
    body: {model: "fake", max_tokens: 100000,
           messages: [{role: "user", content: %(marker)s}]}}));
};
let longChunks = 0;
const ended = new Set();
ws.onmessage = (event) => {
  const f = JSON.parse(event.data);
  if (!f.id) return;
  (out.frames[f.id] = out.frames[f.id] || []).push(f.type);
  if (f.type === "chunk") {
    out.text[f.id] = (out.text[f.id] || "") + (f.data.choices[0].delta.content || "");
    if (f.id === "long" && ++longChunks === 3) {
      ws.send(JSON.stringify({type: "cancel", id: "long"}));
    }
  }
  if (f.type === "done" || f.type === "cancelled" || f.type === "error") {
    ended.add(f.id);
    if (ended.size === 2) ws.close(1000);
  }
};
ws.onclose = (event) => { out.closed = event.code; finish(); };
ws.onerror = () => { out.error = true; };
</script></body></html>
"""


@pytest.fixture(scope="module")
def backend() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=["fake"], ttft=0.01, itl=0.02, tokens=10**9) as fake:
        yield fake


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, backend: FakeBackend) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("wsbrowser"), module_nats_url, module_redis_url,
                 overrides={
                     "nats": {"subject_prefix": "t" + uuid.uuid4().hex[:8]},
                     "models": [{"name": "fake", "backend": "openai",
                                 "base_url": backend.base_url},
                                {"name": "tidegate-sim", "aliases": ["sim"],
                                 "simulator": {"ttft": 0.01, "tokens_per_second": 400.0}}]})
    try:
        p.start()
        yield p
    finally:
        p.stop()


async def _devtools_port(user_data: Path, proc: asyncio.subprocess.Process) -> int:
    """Chromium writes its DevTools port to DevToolsActivePort once it listens."""
    port_file = user_data / "DevToolsActivePort"
    async with asyncio.timeout(30):
        while not port_file.exists() or not port_file.read_text().strip():
            if proc.returncode is not None:
                raise RuntimeError(f"chromium exited with {proc.returncode}")
            await asyncio.sleep(0.05)
    return int(port_file.read_text().split()[0])


async def _page_result(port: int, page_url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        async with asyncio.timeout(30):
            while True:
                async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                    targets = await resp.json()
                pages = [t for t in targets if t.get("type") == "page"
                         and t.get("url", "").startswith(page_url)]
                if pages:
                    break
                await asyncio.sleep(0.1)
    async with ws_connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as cdp:
        msg_id = 0
        async with asyncio.timeout(60):
            while True:
                msg_id += 1
                await cdp.send(json.dumps({
                    "id": msg_id, "method": "Runtime.evaluate",
                    "params": {"expression": "document.getElementById('result').textContent",
                               "returnByValue": True}}))
                while True:
                    answer = json.loads(await cdp.recv())
                    if answer.get("id") == msg_id:
                        break
                value = answer.get("result", {}).get("result", {}).get("value")
                if value:
                    result: dict[str, Any] = json.loads(value)
                    return result
                await asyncio.sleep(0.1)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get "
                                             "install chromium; .ci/run does)")
async def test_browser_runs_two_generations_and_cancels_one(
        pipeline: Pipeline, backend: FakeBackend, tmp_path: Path) -> None:
    assert CHROMIUM is not None
    marker = f"browser-{uuid.uuid4().hex}"
    page = PAGE % {"url": json.dumps(f"ws://127.0.0.1:{pipeline.port}/v1/ws"),
                   "key": json.dumps(DEV_KEY), "marker": json.dumps(marker)}

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=page, content_type="text/html")

    app = web.Application()
    app.router.add_get("/", index)
    user_data = tmp_path / "chromium-profile"
    user_data.mkdir()
    async with serve_app(app) as base:
        page_url = f"{base}/"
        proc = await asyncio.create_subprocess_exec(
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={user_data}", "--remote-debugging-port=0",
            "--remote-allow-origins=*", page_url,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            port = await _devtools_port(user_data, proc)
            result = await _page_result(port, page_url)
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    frames = result["frames"]
    assert frames["reply"][0] == "accepted"
    assert frames["reply"][-1] == "done"
    assert frames["reply"].count("chunk") >= 20
    assert result["text"]["reply"]
    assert frames["long"][0] == "accepted"
    assert frames["long"][-1] == "cancelled"
    assert result["closed"] == 1000
    # The cancelled generation's backend call was closed.
    assert await wait_for(lambda: any(r.closed_at for r in record_for(backend, marker)), 10.0)
