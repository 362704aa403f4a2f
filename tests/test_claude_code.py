"""Claude Code, the real CLI, through tidegate: the npm package
``@anthropic-ai/claude-code`` at the version ``.ci/claude-code`` pins, run
headless (``claude -p``) against a whole pipeline, unchanged.

Claude Code talks to a small recording proxy in front of the edge, so each
test sees what it sent and what the edge answered (headers included). The
model is the simulator, so the text it prints is checked against the text
the simulator writes for the body Claude Code sent; ``sim-tools``
(``simulator.tool_call``) answers with a ``Bash`` call, which Claude Code
runs, so its tool loop goes round. ``native`` is a Messages passthrough
(the fake backend's own ``/v1/messages``), which must get Claude Code's body
as it was sent. Where a llama-server is built (``tests/llama_server.py``), a
turn also goes to it in both modes.

The binary: ``TIDEGATE_CLAUDE_CODE``, else the pinned version in the cache
``.ci/claude-code`` installs into. Without one the tests skip, or fail under
``CI=true`` (``.ci/run``), as ``tests/test_llama_server.py`` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench.fake_backend import FakeBackend, FakeConfig
from tests import llama_server
from tests.clients import Exchange, Recorder, recording, simulator_text
from tests.llama_server import missing
from tests.pipeline import (
    DEV_KEY,
    Pipeline,
    running_pipeline,
    threaded_fake_backend,
    usage_of,
)
from tidegate.apis import estimate_prompt_tokens
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api

pytestmark = pytest.mark.pipeline

INSTALLER = Path(__file__).resolve().parent.parent / ".ci" / "claude-code"
SIM = SimulatorConfig(ttft=0.01, tokens_per_second=400.0, length=24)
MARKER = "tidegate-tool-" + uuid.uuid4().hex[:8]
TOOL_ARGUMENTS = {"command": f"echo {MARKER}", "description": "Print a marker"}
# Claude Code is a large native binary that starts slowly on a loaded box; a
# turn is a few requests. Generous: a bound no healthy run comes near.
RUN_TIMEOUT = 300.0
# llama-server's context for Claude Code's prompt (some 20,000 tokens of
# system prompt and tool definitions) and the answer.
LLAMA_CTX = 65536


def pinned_version() -> str:
    found = re.search(r"^version=(\S+)$", INSTALLER.read_text(), re.MULTILINE)
    assert found, f"no version= line in {INSTALLER}"
    return found.group(1)


def binary() -> str | None:
    """The claude binary to run, or None when there is none."""
    named = os.environ.get("TIDEGATE_CLAUDE_CODE")
    if named:
        return named if os.access(named, os.X_OK) else None
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = cache / "tidegate" / "claude-code" / pinned_version() / "node_modules" / ".bin" / \
        "claude"
    return str(path) if os.access(path, os.X_OK) else None


@pytest.fixture(scope="module")
def claude() -> str:
    path = binary()
    if path is None:
        named = os.environ.get("TIDEGATE_CLAUDE_CODE")
        missing(f"TIDEGATE_CLAUDE_CODE={named} is not an executable" if named else
                f"Claude Code {pinned_version()} is not installed: run .ci/claude-code (npm, "
                "once per machine) and set TIDEGATE_CLAUDE_CODE to the path it prints")
        raise AssertionError("unreachable")
    return path


@pytest.fixture(scope="module")
def native() -> Iterator[FakeBackend]:
    """A backend that serves /v1/messages itself: tidegate passes Claude Code's body on."""
    with threaded_fake_backend(config=FakeConfig(models=("fake-model",), ttft=0.01, itl=0.002,
                                                 tokens=12)) as backend:
        yield backend


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str, native: FakeBackend) -> Iterator[Pipeline]:
    simulator = {"ttft": SIM.ttft, "tokens_per_second": SIM.tokens_per_second,
                 "length": SIM.length}
    models: list[dict[str, Any]] = [
        {"name": "tidegate-sim", "aliases": ["sim"], "simulator": simulator},
        {"name": "sim-tools", "simulator": {**simulator, "tool_call": "Bash",
                                            "tool_arguments": json.dumps(TOOL_ARGUMENTS)}},
        {"name": "native", "backend": "openai", "base_url": native.base_url,
         "upstream_model": "fake-model", "messages": "passthrough"},
    ]
    yield from running_pipeline(tmp_path_factory.mktemp("claude-code"), module_nats_url,
                                module_redis_url,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "cc" + uuid.uuid4().hex[:6]}})


@pytest.fixture
async def recorder(pipeline: Pipeline) -> AsyncIterator[tuple[Recorder, str]]:
    async with recording(pipeline.url, RUN_TIMEOUT) as proxy_url:
        yield proxy_url


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


async def run_claude(claude: str, base_url: str, home: Path, *args: str, model: str = "sim",
                     auth: str = "ANTHROPIC_API_KEY") -> Run:
    """``claude -p ARGS`` headless and offline: its own HOME and config dir,
    no telemetry, updater, error reports or other non-essential traffic, every
    model name Claude Code might ask for mapped to ``model``."""
    os.makedirs(home, exist_ok=True)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
           "CLAUDE_CONFIG_DIR": str(home / ".claude"), "ANTHROPIC_BASE_URL": base_url,
           auth: DEV_KEY, "ANTHROPIC_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1"}
    proc = await asyncio.create_subprocess_exec(
        claude, "-p", *args, cwd=home, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(RUN_TIMEOUT):
            out, err = await proc.communicate()
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    return Run(proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace"))


def events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: ")]


def answer(exchange: Exchange) -> tuple[str, str]:
    """The text and stop reason of a streamed Messages answer."""
    evs = events(exchange.response)
    text = "".join(e["delta"].get("text", "") for e in evs if e["type"] == "content_block_delta")
    [stop] = [e["delta"]["stop_reason"] for e in evs if e["type"] == "message_delta"]
    return text, stop


def refused(recorder: Recorder) -> list[tuple[str, int, bytes]]:
    return recorder.refused()


def turn(recorder: Recorder, prompt: str) -> Exchange:
    """The one ``/v1/messages`` exchange whose user turns hold ``prompt``.
    Claude Code may send others beside it (a CI run once saw two calls for
    one ``-p``); two of this turn would be a retry, and fail."""
    sent = recorder.to("/v1/messages")
    mine = [e for e in sent if any(prompt in json.dumps(m.get("content"))
                                   for m in e.body["messages"] if m.get("role") == "user")]
    assert len(mine) == 1, [_seen(e) for e in sent]
    return mine[0]


def _seen(exchange: Exchange) -> dict[str, Any]:
    """What a failure shows of one exchange: enough to tell a retry, a
    continuation after ``max_tokens`` and a side call apart."""
    stops = [e["delta"].get("stop_reason") for e in events(exchange.response)
             if e.get("type") == "message_delta"]
    return {"status": exchange.status, "model": exchange.body.get("model"),
            "max_tokens": exchange.body.get("max_tokens"), "stops": stops,
            "messages": len(exchange.body.get("messages", [])),
            "last": json.dumps(exchange.body.get("messages", [])[-1:])[-300:]}


async def test_version_is_the_pinned_one(claude: str, tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        claude, "--version", env={"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path),
                                  "DISABLE_AUTOUPDATER": "1"},
        stdout=asyncio.subprocess.PIPE)
    async with asyncio.timeout(RUN_TIMEOUT):
        out, _ = await proc.communicate()
    assert out.decode().split()[0] == pinned_version()


async def test_one_turn(claude: str, recorder: tuple[Recorder, str], pipeline: Pipeline,
                        tmp_path: Path) -> None:
    """``claude -p "Say hello"`` completes, printing the simulator's text, and
    what it sent (a ``system`` turn inside ``messages``, ``thinking``,
    ``context_management``, ``output_config``, ``?beta=true``) was accepted.
    Its ``metadata.user_id`` (a JSON text) named the usage record's user."""
    proxy, url = recorder
    run = await run_claude(claude, url, tmp_path / "home", "Say hello")
    assert run.returncode == 0, (run.stdout, run.stderr, refused(proxy))
    assert not refused(proxy)
    sent = turn(proxy, "Say hello")
    assert sent.path == "/v1/messages?beta=true"
    text, stop = answer(sent)
    assert stop == "end_turn"
    assert text == await simulator_text(Api.MESSAGES, sent.body, SIM)
    assert run.stdout.strip() == text.strip()
    [record] = await usage_of(pipeline.config, sent.response_headers["request-id"])
    ids = json.loads(sent.body["metadata"]["user_id"])
    assert record.user == (ids["account_uuid"] or ids["device_id"])


async def test_stream_json(claude: str, recorder: tuple[Recorder, str], tmp_path: Path) -> None:
    """``--output-format stream-json``: the answer reaches Claude Code as a
    stream of deltas, and its result line carries the whole text."""
    proxy, url = recorder
    run = await run_claude(claude, url, tmp_path / "home", "Say hello", "--output-format",
                           "stream-json", "--verbose", "--include-partial-messages")
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr, refused(proxy))
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    sent = turn(proxy, "Say hello")
    text, _ = answer(sent)
    deltas = [ln["event"]["delta"]["text"] for ln in lines if ln["type"] == "stream_event"
              and ln["event"]["type"] == "content_block_delta"]
    assert len(deltas) == SIM.length  # one per token, as the simulator streamed them
    assert "".join(deltas) == text
    result = lines[-1]
    assert result["type"] == "result"
    assert result["subtype"] == "success"
    assert result["is_error"] is False
    assert result["result"].strip() == text.strip()


async def test_multi_turn_session_with_a_tool_round_trip(
        claude: str, recorder: tuple[Recorder, str], tmp_path: Path) -> None:
    """Two turns of one session on ``sim-tools``: each a tool_use of Bash,
    Claude Code running it, its tool_result (the command's output) going back,
    then text; the second turn carries the first in its history."""
    proxy, url = recorder
    home, session = tmp_path / "home", str(uuid.uuid4())
    tools = ("--allowedTools", "Bash", "--model", "sim-tools")
    first = await run_claude(claude, url, home, "Print the marker", "--session-id", session,
                             *tools, model="sim-tools")
    assert first.returncode == 0, (first.stdout, first.stderr, refused(proxy))
    second = await run_claude(claude, url, home, "Once more", "--resume", session, *tools,
                              model="sim-tools")
    assert second.returncode == 0, (second.stdout, second.stderr, refused(proxy))
    assert not refused(proxy)
    sent = proxy.to("/v1/messages")
    assert [answer(e)[1] for e in sent] == ["tool_use", "end_turn", "tool_use", "end_turn"]
    for call, back in ((sent[0], sent[1]), (sent[2], sent[3])):
        [use] = [e["content_block"] for e in events(call.response)
                 if e["type"] == "content_block_start"]
        assert use["name"] == "Bash"
        results = [b for b in back.body["messages"][-1]["content"]
                   if isinstance(b, dict) and b.get("type") == "tool_result"]
        assert [r["tool_use_id"] for r in results] == [use["id"]]
        assert MARKER in json.dumps(results[0]["content"])  # Claude Code ran the command
        assert not results[0].get("is_error")
    history = json.dumps(sent[3].body["messages"])
    assert "Print the marker" in history
    assert history.count(MARKER) >= 2
    assert first.stdout.strip() == answer(sent[1])[0].strip()
    assert second.stdout.strip() == answer(sent[3])[0].strip()


async def test_count_tokens(claude: str, recorder: tuple[Recorder, str], tmp_path: Path) -> None:
    """``/context`` counts tokens as Claude Code does it:
    ``/v1/messages/count_tokens?beta=true`` (here with ANTHROPIC_AUTH_TOKEN,
    a bearer key); the edge answers each with its estimate."""
    proxy, url = recorder
    run = await run_claude(claude, url, tmp_path / "home", "/context",
                           auth="ANTHROPIC_AUTH_TOKEN")
    assert run.returncode == 0, (run.stdout, run.stderr, refused(proxy))
    counted = [e for e in proxy.exchanges if e.path.split("?")[0] == "/v1/messages/count_tokens"]
    assert counted, [e.path for e in proxy.exchanges]
    for e in counted:
        assert e.headers.get("Authorization") == f"Bearer {DEV_KEY}"
        assert e.status == 200, e.response
        assert e.response_headers["x-tidegate-token-count"] == "estimate"
        assert e.json() == {"input_tokens": estimate_prompt_tokens(Api.MESSAGES, e.body)}
    assert "Context Usage" in run.stdout


async def test_passthrough_gets_the_body_as_sent(claude: str, recorder: tuple[Recorder, str],
                                                 native: FakeBackend, tmp_path: Path) -> None:
    """On a Messages passthrough model the backend gets Claude Code's body as
    it was sent (``model`` aside: the upstream name), system turns and all,
    and its ``anthropic-beta`` header unchanged."""
    proxy, url = recorder
    seen = len(native.records)
    run = await run_claude(claude, url, tmp_path / "home", "Say hello", model="native")
    assert run.returncode == 0, (run.stdout, run.stderr, refused(proxy))
    sent = turn(proxy, "Say hello")
    [got] = [r for r in list(native.records)[seen:] if r.path.endswith("/messages")]
    assert got.body == {**sent.body, "model": "fake-model"}
    assert got.headers["anthropic-beta"] == sent.headers["anthropic-beta"]
    assert run.stdout.strip() == answer(sent)[0].strip()


# -- against llama.cpp's llama-server, where CI builds one ------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """llama-server with the tiny random-weight model, its context large
    enough for Claude Code's prompt."""
    path = llama_server.require()
    from tests.llama_model import write_tiny_llama

    workdir = tmp_path_factory.mktemp("llama-claude-code")
    model = write_tiny_llama(workdir / "tiny.gguf", n_ctx=LLAMA_CTX)
    proc, url = llama_server.start(path, model, workdir, "llama-cc", parallel=1, ctx=LLAMA_CTX)
    try:
        yield url
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def llama_pipeline(claude: str, llama: str, tmp_path_factory: pytest.TempPathFactory,
                   module_nats_url: str, module_redis_url: str) -> Iterator[Pipeline]:
    models = [{"name": f"tiny-{mode}", "backend": "openai", "base_url": f"{llama}/v1",
               "upstream_model": "tiny", "messages": mode}
              for mode in ("passthrough", "translate")]
    yield from running_pipeline(tmp_path_factory.mktemp("claude-code-llama"), module_nats_url,
                                module_redis_url,
                                overrides={"models": models,
                                           "nats": {"subject_prefix": "cl" + uuid.uuid4().hex[:6]}})


@pytest.mark.parametrize("mode", ["passthrough", "translate"])
async def test_one_turn_on_llama_server(claude: str, llama_pipeline: Pipeline, mode: str,
                                        tmp_path: Path) -> None:
    """``claude -p`` through tidegate to a real model server, in both modes:
    llama-server's own /v1/messages gets Claude Code's body as sent (system
    turn, thinking and all), its chat/completions the translation. The text is
    the tiny model's gibberish, which it ends by itself within a few hundred
    tokens (Claude Code treats an answer cut at ``max_tokens`` as an error)."""
    async with recording(llama_pipeline.url, RUN_TIMEOUT) as (proxy, url):
        run = await run_claude(claude, url, tmp_path / "home", "Say hello",
                               model=f"tiny-{mode}")
    assert run.returncode == 0, (run.stdout, run.stderr, refused(proxy))
    sent = turn(proxy, "Say hello")
    assert sent.status == 200, [_seen(e) for e in proxy.to("/v1/messages")]
    assert any(m["role"] == "system" for m in sent.body["messages"])
    text, stop = answer(sent)
    assert stop == "end_turn", [_seen(e) for e in proxy.to("/v1/messages")]
    assert run.stdout.strip() == text.strip()
