"""The operator console in a real browser: headless Chromium, driven over the
DevTools protocol (CDP, spoken with the ``websockets`` client), loads
``tidegate console`` beside a real pipeline with traffic running, signs in with
an admin key, reads the live numbers from the page and checks them against
``tidegate status --json``, reads usage and checks it against the requests the
test made, creates a key through the page and sees it work at the edge, revokes
it through the page and sees the edge refuse it, and saves a screenshot. The
page must log no console error and throw no exception.

The screenshot goes to ``$TIDEGATE_ARTIFACTS/console.png`` (default
``artifacts/``; CI keeps that directory) and, with ``TIDEGATE_UPDATE_DOCS=1``,
to ``docs/console.png`` (docs/console.md shows it).
Skips, saying why, where Chromium is absent."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect

from tests.console_helpers import cli, create_key, running_console, status_json
from tests.pipeline import DEV_KEY, Pipeline
from tests.poll import eventually

pytestmark = [pytest.mark.pipeline,
              pytest.mark.skipif((shutil.which("chromium") or shutil.which("chromium-browser"))
                                 is None, reason="chromium is not installed (Debian: apt-get "
                                                 "install chromium; .ci/run does)")]

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "chromium"
WIDTH = 1400


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    # A paced simulator: each answer takes about a second, so traffic keeps
    # streams in flight while the page is read.
    p = Pipeline(tmp_path_factory.mktemp("console-browser"), module_nats_url,
                 module_redis_url, workers=2, overrides={
                     "nats": {"subject_prefix": "b" + uuid.uuid4().hex[:8]},
                     "models": [{"name": "tidegate-sim", "aliases": ["sim"], "max_streams": 4,
                                 "simulator": {"ttft": 0.05, "tokens_per_second": 40.0,
                                               "length": 40}}]})
    try:
        p.start()
        yield p
    finally:
        p.stop()


class Cdp:
    """One page's DevTools session: commands by id, events kept."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.next_id = 0
        self.waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self.events: list[dict[str, Any]] = []

    async def read(self) -> None:
        async for raw in self.ws:
            msg = json.loads(raw)
            if "id" in msg and msg["id"] in self.waiting:
                self.waiting.pop(msg["id"]).set_result(msg)
            elif "method" in msg:
                self.events.append(msg)

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting[self.next_id] = future
        await self.ws.send(json.dumps({"id": self.next_id, "method": method,
                                       "params": params}))
        async with asyncio.timeout(60):
            answer = await future
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    async def js(self, expression: str) -> Any:
        out = await self.send("Runtime.evaluate", expression=expression, returnByValue=True,
                              awaitPromise=True)
        if "exceptionDetails" in out:
            raise RuntimeError(f"{expression[:80]}: {out['exceptionDetails']}")
        return out["result"].get("value")

    def errors(self) -> list[dict[str, Any]]:
        """Console errors and uncaught exceptions the page reported."""
        out = []
        for e in self.events:
            params = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown" or (
                    e["method"] == "Runtime.consoleAPICalled"
                    and params.get("type") in ("error", "assert")) or (
                    e["method"] == "Log.entryAdded"
                    and params.get("entry", {}).get("level") == "error"):
                out.append(e)
        return out


@contextlib.asynccontextmanager
async def browser(tmp_path: Path) -> AsyncIterator[Cdp]:
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", f"--window-size={WIDTH},900",
        f"--user-data-dir={profile}", "--remote-debugging-port=0",
        "--remote-allow-origins=*", "about:blank",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        port_file = profile / "DevToolsActivePort"
        async with asyncio.timeout(60):
            while not port_file.exists() or not port_file.read_text().strip():
                if proc.returncode is not None:
                    raise RuntimeError(f"chromium exited with {proc.returncode}")
                await asyncio.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            async with aiohttp.ClientSession() as session:
                while True:
                    async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
                        pages = [t for t in await resp.json() if t.get("type") == "page"]
                    if pages:
                        break
                    await asyncio.sleep(0.1)
        async with ws_connect(pages[0]["webSocketDebuggerUrl"], max_size=None) as ws:
            cdp = Cdp(ws)
            reader = asyncio.create_task(cdp.read())
            try:
                for domain in ("Page", "Runtime", "Log"):
                    await cdp.send(f"{domain}.enable")
                yield cdp
            finally:
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await reader
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def chat(session: aiohttp.ClientSession, url: str, key: str) -> int:
    async with session.post(f"{url}/v1/chat/completions", headers={
            "Authorization": f"Bearer {key}"}, json={
            "model": "sim", "stream": True, "max_tokens": 40,
            "messages": [{"role": "user", "content": "hello console"}]}) as resp:
        await resp.read()
        return resp.status


async def traffic(url: str, key: str, done: list[int], stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            if await chat(session, url, key) == 200:
                done.append(1)


ROWS = """JSON.stringify([...document.querySelectorAll('%s tbody tr[%s]')].map(tr =>
  Object.fromEntries([...tr.cells].filter(c => c.dataset.field)
                                  .map(c => [c.dataset.field, c.textContent]))))"""


async def rows(cdp: Cdp, table: str, marker: str) -> list[dict[str, str]]:
    out: list[dict[str, str]] = json.loads(await cdp.js(ROWS % (table, marker)))
    return out


def save_screenshot(png: bytes) -> list[Path]:
    paths = [Path(os.environ.get("TIDEGATE_ARTIFACTS", ROOT / "artifacts")) / "console.png"]
    if os.environ.get("TIDEGATE_UPDATE_DOCS") == "1":
        paths.append(ROOT / "docs" / "console.png")
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(png)
    return paths


async def test_console_in_a_browser(pipeline: Pipeline, tmp_path: Path) -> None:
    admin = create_key(pipeline, "ops", "--admin")
    tenant = create_key(pipeline, "acme")
    # Something in the admin tables (the screenshot shows them).
    cli(pipeline, "policy", "set", "--tenant", "acme", "--rpm", "6000", "--concurrency", "8")
    cli(pipeline, "tenant", "set", "acme", "--resumable", "on", "--grace", "30")
    stop = asyncio.Event()
    acme_done: list[int] = []
    dev_done: list[int] = []
    with running_console(pipeline, interval=1.0) as console:
        loads = [asyncio.create_task(traffic(pipeline.url, tenant["key"], acme_done, stop))
                 for _ in range(3)]
        loads.append(asyncio.create_task(traffic(pipeline.url, DEV_KEY, dev_done, stop)))
        try:
            async with browser(tmp_path) as cdp:
                await cdp.send("Page.navigate", url=f"{console}/console")
                await eventually(lambda: cdp.js("document.readyState === 'complete' && "
                                                "document.body.dataset.state === "
                                                "'signed-out'"), 30, "the sign-in form")
                await cdp.js(f"document.getElementById('signin-key').value = "
                             f"{json.dumps(admin['key'])}; "
                             "document.getElementById('signin-form').requestSubmit()")
                await eventually(lambda: cdp.js("document.body.dataset.state === "
                                                "'signed-in'"), 30, "signed in")
                assert admin["key"] not in await cdp.js("document.documentElement.outerHTML")

                # Live: the page's numbers against `tidegate status --json`. The
                # two are read one after the other while traffic runs, and on a
                # busy machine a model may enter or leave queue mode between
                # them (its backend's TTFT crosses the threshold), so they are
                # compared until one pair agrees; the last mismatch is the error.
                async def agrees() -> list[dict[str, str]] | None:
                    models = await rows(cdp, "#models", "data-model")
                    if not [m for m in models if m["tokens_per_s"] not in ("0", "-")
                            and m["ttft_p50"] != "-"]:
                        return None  # no live numbers yet
                    status = await asyncio.to_thread(status_json, pipeline)
                    page = {m["model"]: m for m in models}
                    assert set(page) == {m["model"] for m in status["models"]}
                    for m in status["models"]:
                        row = page[m["model"]]
                        assert int(row["workers"]) == m["workers"] == 2, (row, m)
                        assert int(row["slots"]) == m["slots"]["total"] == 8, (row, m)
                        assert 0 <= int(row["in_flight"]) <= m["slots"]["total"], (row, m)
                        assert row["mode"] == m["queue_mode"]["mode"], (row, m)
                        assert row["held"] == str(m["queue_mode"]["queued"]), (row, m)
                        assert row["adaptive_limit"] == (
                            str(m["slots"]["total"]) if m["adaptive"] else "-"), (row, m)
                        assert row["queue_limit"] == (
                            str(m["queue_mode"]["limit"]) if row["mode"] == "queue"
                            else "-"), (row, m)
                        assert row["ttft_p50"].endswith(" ms"), row
                    workers = await rows(cdp, "#workers", "data-worker")
                    assert {w["worker_id"] for w in workers} == {
                        w["worker_id"] for w in status["workers"]}
                    edges = await rows(cdp, "#edges", "data-edge")
                    assert {e["edge_id"] for e in edges} == {
                        e["edge_id"] for e in status["edges"]["edges"]}
                    return models

                await eventually(agrees, 90, "the page agreeing with tidegate status",
                                 step=0.5)

                # At least one sample saw streams in flight (traffic is running).
                async def saw_in_flight() -> bool:
                    history = await cdp.js(
                        "fetch('/console/api/status', {headers: "
                        "{Authorization: 'Bearer ' + sessionStorage"
                        ".getItem('tidegate-console-key')}})"
                        ".then(r => r.json()).then(v => v.history)")
                    return any(p["models"]["tidegate-sim"]["in_flight"] > 0 for p in history)

                await eventually(saw_in_flight, 60, "a sample with streams in flight", step=0.5)

                # The screenshot, with traffic running and a few charted samples,
                # before a key is shown on the page.
                await eventually(lambda: cdp.js(
                    "document.querySelector('#chart-tps polyline') && document.querySelector("
                    "'#chart-tps polyline').getAttribute('points').split(' ').length >= 12"),
                    60, "a dozen chart points")
                size = (await cdp.send("Page.getLayoutMetrics"))["cssContentSize"]
                height = min(int(size["height"]) + 1, 4000)
                await cdp.send("Emulation.setDeviceMetricsOverride", width=WIDTH,
                               height=height, deviceScaleFactor=1, mobile=False)
                shot = await cdp.send("Page.captureScreenshot", format="png",
                                      clip={"x": 0, "y": 0, "width": WIDTH, "scale": 1,
                                            "height": height})
                png = base64.b64decode(shot["data"])
                assert png.startswith(b"\x89PNG")
                for path in save_screenshot(png):
                    assert path.stat().st_size > 10_000

                # Usage: stop the traffic, then the page's counts are the requests made.
                stop.set()
                await asyncio.gather(*loads)
                acme_key_id = tenant["key_id"]

                async def usage_settled() -> bool:
                    by_key = {r["key"]: r for r in await rows(cdp, "#usage-key", "data-key")}
                    row = by_key.get(acme_key_id)
                    return row is not None and int(row["requests"]) == len(acme_done)

                await eventually(usage_settled, 60, "usage of the tenant key", step=0.5)
                by_tenant = {r["tenant"]: r for r in await rows(cdp, "#usage-tenant",
                                                                 "data-tenant")}
                assert int(by_tenant["acme"]["requests"]) == len(acme_done) > 0
                assert int(by_tenant["acme"]["completion_tokens"]) > 0
                # The default tenant's count includes the pipeline's own start-up pings.
                assert int(by_tenant["default"]["requests"]) >= len(dev_done)

                # Admin: create a key through the page; it works at the edge ...
                await cdp.js("""(() => { const f = document.getElementById('key-form');
                    f.tenant.value = 'made-in-browser'; f.requestSubmit(); })()""")
                new_key = await eventually(lambda: cdp.js(
                    "document.getElementById('new-key-value').textContent"), 30,
                    "the new key on the page")
                assert new_key.startswith("sk-tg-")
                async with aiohttp.ClientSession() as session:
                    await eventually(lambda: _works(session, pipeline.url, new_key), 30,
                                     "the page's key accepted by the edge", step=0.5)
                    key_id = await cdp.js(
                        "[...document.querySelectorAll('#keys tbody tr')].find(tr => "
                        "tr.cells[1].textContent === 'made-in-browser').dataset.key")
                    # ... and revoked through the page, the edge refuses it.
                    await cdp.js(f"document.querySelector('button[data-revoke=\"{key_id}\"]')"
                                 ".click()")
                    await eventually(lambda: cdp.js(
                        f"!document.querySelector('#keys tr[data-key=\"{key_id}\"]')"), 30,
                        "the key gone from the page's list")

                    async def refused() -> bool:
                        return await chat(session, pipeline.url, new_key) == 401

                    await eventually(refused, 30, "the revoked key refused", step=0.5)
                assert await cdp.js("document.getElementById('admin-result').textContent") \
                    == f"revoked key {key_id}"
                assert cdp.errors() == []
        finally:
            stop.set()
            for task in loads:
                task.cancel()
            await asyncio.gather(*loads, return_exceptions=True)


async def _works(session: aiohttp.ClientSession, url: str, key: str) -> bool:
    return await chat(session, url, key) == 200
