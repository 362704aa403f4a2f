"""``tidegate up``: planning in-process, then the real thing as a subprocess.

The subprocess tests run the whole gateway (embedded nats-server and redis-server, dispatcher,
worker, edge) as a user would, talk to it with the openai SDK; SIGTERM leaves no process or port.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from fleet.run.banner import banner
from fleet.run.planning import (
    UpOptions,
    child_environment,
    prepare,
)
from fleet.run.servers import free_port, http_ok, port_is_free
from tests.servers import descendants, is_alive, kill_all, proc_identity, wait_until
from tidegate import config as tgconfig
from tidegate.config import DEFAULT_MAX_OUTPUT_TOKENS
from tidegate.errors import ConfigError, TidegateError

pytestmark = pytest.mark.usefixtures("clean_env")

DEV_KEY = "sk-tg-launcher-test-key"
READY_TIMEOUT = 90.0


# --------------------------------------------------------------------------
# prepare(): no processes
# --------------------------------------------------------------------------


def test_dev_key_is_generated_once_and_kept(tmp_path: Path) -> None:
    first = prepare(UpOptions(data_dir=tmp_path), env={})
    key = first.config.auth.dev_key
    assert re.fullmatch(r"sk-tg-[A-Za-z0-9_-]{32}", key)  # README: sk-tg-...
    assert (tmp_path / "dev_key").read_text().strip() == key
    assert (tmp_path / "dev_key").stat().st_mode & 0o777 == 0o600
    assert prepare(UpOptions(data_dir=tmp_path), env={}).config.auth.dev_key == key
    env_key = prepare(UpOptions(data_dir=tmp_path), env={"TIDEGATE_DEV_KEY": "sk-env"})
    assert env_key.config.auth.dev_key == "sk-env"


def test_embedded_servers_get_free_ports(tmp_path: Path) -> None:
    plan = prepare(UpOptions(data_dir=tmp_path), env={})
    assert plan.nats_port is not None
    assert plan.redis_port is not None
    assert plan.config.nats.url == f"nats://127.0.0.1:{plan.nats_port}"
    # The embedded Redis has a password, in the URL the tiers get.
    assert plan.redis_password
    assert plan.config.redis.url == (
        f"redis://:{plan.redis_password}@127.0.0.1:{plan.redis_port}/0")
    assert plan.redis_password not in banner(plan)
    assert plan.options.nats_monitor_port is None  # off unless asked for
    for port, default in ((plan.nats_port, 4222), (plan.redis_port, 6379)):
        assert port == default or not port_is_free(default)
    assert [m.name for m in plan.config.models] == ["tidegate-sim"]


def test_external_urls_are_used_as_given(tmp_path: Path) -> None:
    plan = prepare(UpOptions(data_dir=tmp_path, nats_url="nats://10.1.1.1:4222"),
                   env={"TIDEGATE_REDIS_URL": "redis://10.1.1.2:6379/2"})
    assert (plan.nats_port, plan.redis_port) == (None, None)
    assert plan.config.nats.url == "nats://10.1.1.1:4222"
    assert plan.config.redis.url == "redis://10.1.1.2:6379/2"

    path = tmp_path / "c.toml"
    path.write_text('[nats]\nurl = "nats://10.1.1.3:4222"\n')
    plan = prepare(UpOptions(data_dir=tmp_path, config_path=str(path)), env={})
    assert plan.nats_port is None
    assert plan.redis_port is not None
    assert plan.config.nats.url == "nats://10.1.1.3:4222"


def test_edge_port(tmp_path: Path) -> None:
    port = free_port()
    plan = prepare(UpOptions(data_dir=tmp_path, port=port), env={})
    assert plan.config.edge.port == port
    assert plan.base_url == f"http://127.0.0.1:{port}/v1"
    plan = prepare(UpOptions(data_dir=tmp_path), env={"TIDEGATE__EDGE__PORT": str(port)})
    assert plan.config.edge.port == port  # the configured port, since it is free
    plan = prepare(UpOptions(data_dir=tmp_path, host="0.0.0.0", port=port), env={})
    assert plan.base_url == f"http://127.0.0.1:{port}/v1"


def test_child_environment_drops_config_variables() -> None:
    env = child_environment({"TIDEGATE__EDGE__PORT": "1", "TIDEGATE_DEV_KEY": "k",
                             "TIDEGATE_CONFIG": "x", "HOME": "/root", "OTHER": "y"})
    assert not [k for k in env if k.startswith("TIDEGATE")]
    assert env["HOME"] == "/root"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert str(Path(__file__).resolve().parent.parent) in env["PYTHONPATH"].split(os.pathsep)


def test_invalid_options(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--workers"):
        prepare(UpOptions(data_dir=tmp_path, workers=0), env={})
    with pytest.raises(ConfigError, match="--backend"):
        prepare(UpOptions(data_dir=tmp_path, models=("m",)), env={})


class _ModelsHandler(http.server.BaseHTTPRequestHandler):
    seen: list[tuple[str, str | None]] = []
    props: dict[str, object] | None = None  # llama-server's /props; None: 404

    def do_GET(self) -> None:
        type(self).seen.append((self.path, self.headers.get("Authorization")))
        if self.path == "/props" and self.props is not None:
            body = json.dumps(self.props).encode()
        elif self.path != "/v1/models":
            self.send_error(404)
            return
        else:
            body = json.dumps({"object": "list", "data": [
                {"id": "org/llama-3:8b", "object": "model", "max_model_len": 8192},
                {"id": "qwen2.5", "object": "model"},
            ]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def models_server() -> Iterator[str]:
    _ModelsHandler.seen = []
    _ModelsHandler.props = None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ModelsHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_backend_models_are_listed(tmp_path: Path, models_server: str) -> None:
    plan = prepare(UpOptions(data_dir=tmp_path, backends=(f"{models_server}/v1/",),
                             backend_key_env="UPSTREAM_KEY"),
                   env={"UPSTREAM_KEY": "sk-upstream"})
    assert [(m.name, m.backend, m.base_url, m.api_key_env) for m in plan.config.models] == [
        ("org/llama-3:8b", "openai", f"{models_server}/v1", "UPSTREAM_KEY"),
        ("qwen2.5", "openai", f"{models_server}/v1", "UPSTREAM_KEY"),
    ]
    # vLLM's max_model_len bounds max_output_tokens; a model listed without
    # one (and no llama-server /props) keeps the default.
    assert [m.max_output_tokens for m in plan.config.models] == [8192,
                                                                 DEFAULT_MAX_OUTPUT_TOKENS]
    assert _ModelsHandler.seen == [("/v1/models", "Bearer sk-upstream"),
                                   ("/props", "Bearer sk-upstream")]


def test_llamacpp_context_bounds_max_output_tokens(tmp_path: Path,
                                                   models_server: str) -> None:
    _ModelsHandler.props = {"default_generation_settings": {"n_ctx": 4096}}
    plan = prepare(UpOptions(data_dir=tmp_path, backends=(f"{models_server}/v1",)), env={})
    assert [(m.name, m.max_output_tokens) for m in plan.config.models] == [
        ("org/llama-3:8b", 8192), ("qwen2.5", 4096)]


def test_backend_with_model_names_does_not_list(tmp_path: Path, models_server: str) -> None:
    plan = prepare(UpOptions(data_dir=tmp_path, backends=(f"{models_server}/v1",),
                             models=("mine",)), env={})
    assert [m.name for m in plan.config.models] == ["mine"]
    assert _ModelsHandler.seen == []


def test_two_backends_with_one_model_name_are_two_replicas(tmp_path: Path,
                                                            models_server: str) -> None:
    """`tidegate up --backend URL --backend URL2` naming the same model: one
    model with two replicas (docs/routing.md), not a name clash."""
    other = models_server.replace("127.0.0.1", "localhost")
    plan = prepare(UpOptions(data_dir=tmp_path, backends=(f"{models_server}/v1",
                                                          f"{other}/v1"),
                             models=("llama",)), env={})
    (model,) = plan.config.models
    assert model.name == "llama"
    assert model.replicas == (f"{models_server}/v1", f"{other}/v1")
    assert len(model.replica_names) == 2


def test_backend_listing_failure_says_pass_model(tmp_path: Path, models_server: str) -> None:
    with pytest.raises(TidegateError, match="--model") as info:
        prepare(UpOptions(data_dir=tmp_path, backends=(f"{models_server}/nope",)), env={})
    assert "404" in str(info.value)
    dead = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(TidegateError, match="--model"):
        prepare(UpOptions(data_dir=tmp_path, backends=(dead,)), env={})


def test_banner(tmp_path: Path) -> None:
    plan = prepare(UpOptions(data_dir=tmp_path, port=free_port()),
                   env={"TIDEGATE_DEV_KEY": DEV_KEY})
    text = banner(plan)
    assert f"URL:      {plan.base_url}" in text
    assert DEV_KEY in text
    assert "tidegate-sim" in text
    # gRPC is on under `tidegate up` (off in the default config), on its own port.
    assert plan.config.edge.grpc_port not in (0, plan.config.edge.port)
    assert f"gRPC:     127.0.0.1:{plan.config.edge.grpc_port}  (tidegate.v1.Gateway" in text
    assert f"curl -N {plan.base_url}/chat/completions" in text
    assert '"stream": true' in text
    assert "stream=True" in text
    assert "logs" in text
    # Every process's /metrics, and how to see the fleet.
    # The edge's is on a port of its own, not the keyless API port (issue 24).
    assert f"Metrics:  http://127.0.0.1:{plan.metrics_ports['edge']}/metrics  (edge)" in text
    assert f"{plan.base_url.removesuffix('/v1')}/metrics" not in text
    for name in ("dispatcher", "worker-1"):
        assert f"127.0.0.1:{plan.metrics_ports[name]}/metrics  ({name})" in text
    assert f"tidegate status --config {plan.config_file}" in text
    # The operator console's URL, and how to get a key that may sign in.
    assert plan.console_url == f"http://127.0.0.1:{plan.console_port}/console"
    assert f"Console:  {plan.console_url}" in text
    assert "tidegate keys create --admin" in text
    assert plan.console_port not in {plan.config.edge.port, *plan.metrics_ports.values()}
    off = prepare(UpOptions(data_dir=tmp_path, port=free_port(), console_port=0), env={})
    assert off.console_url is None
    assert "Console:" not in banner(off)
    assert plan.env_for("worker-1")["TIDEGATE_METRICS_PORT"] == str(plan.metrics_ports["worker-1"])
    assert plan.env_for("edge")["TIDEGATE_METRICS_PORT"] == str(plan.metrics_ports["edge"])
    assert plan.metrics_ports["edge"] != plan.config.edge.port
    # The SDK snippet is valid Python.
    snippet = text.split("(pip install openai):", 1)[1].split("Press Ctrl-C", 1)[0]
    compile("\n".join(line[2:] for line in snippet.splitlines()), "<banner>", "exec")


# --------------------------------------------------------------------------
# tidegate up as a subprocess
# --------------------------------------------------------------------------


class Up:
    """A running ``tidegate up`` with its output in files."""

    def __init__(self, data_dir: Path, *args: str) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.stdout_path = data_dir.parent / f"{data_dir.name}.stdout"
        self.stderr_path = data_dir.parent / f"{data_dir.name}.stderr"
        env = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
        env["TIDEGATE_DEV_KEY"] = DEV_KEY
        with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fleet", "up", "--port", str(self.port),
                 "--data-dir", str(data_dir), *args],
                stdout=out, stderr=err, env=env, start_new_session=True)
        self.children: list[tuple[int, int]] = []

    def output(self) -> str:
        return self.stdout_path.read_text()

    def diagnostics(self) -> str:
        parts = [f"stdout:\n{self.output()}", f"stderr:\n{self.stderr_path.read_text()}"]
        for log in sorted((self.data_dir / "logs").glob("*.log")):
            parts.append(f"{log.name}:\n" + "\n".join(log.read_text().splitlines()[-30:]))
        return "\n\n".join(parts)

    def wait_url(self) -> str:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            found = re.search(r"URL:\s+(http://\S+/v1)", self.output())
            if found:
                self.children = descendants(self.proc.pid)
                return found[1]
            if self.proc.poll() is not None:
                pytest.fail(f"tidegate up exited with {self.proc.returncode}\n"
                            f"{self.diagnostics()}")
            time.sleep(0.1)
        pytest.fail(f"tidegate up printed no URL within {READY_TIMEOUT}s\n{self.diagnostics()}")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        kill_all(self.children)


@pytest.fixture
def start_up(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    """Starts ``tidegate up`` with extra arguments; kills whatever is left at the end."""
    started: list[Up] = []

    def start(*args: str) -> Up:
        running = Up(tmp_path / f"data{len(started)}", *args)
        started.append(running)
        return running

    try:
        yield start
    finally:
        for running in started:
            running.cleanup()


@pytest.fixture
def up(start_up: Callable[..., Up]) -> Up:
    return start_up()


@pytest.mark.pipeline
def test_up_serves_a_streaming_chat_and_stops_cleanly(up: Up) -> None:
    url = up.wait_url()
    assert url == f"http://127.0.0.1:{up.port}/v1"
    out = up.output()
    assert DEV_KEY in out
    assert "tidegate-sim" in out
    assert "curl -N" in out

    with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/readyz", timeout=5) as response:
        assert response.status == 200

    client = openai.OpenAI(base_url=url, api_key=DEV_KEY, max_retries=0, timeout=30)
    with client, client.chat.completions.create(
            model="tidegate-sim", stream=True, max_tokens=16,
            messages=[{"role": "user", "content": "Say hello"}]) as stream:
        content = "".join(chunk.choices[0].delta.content or ""
                          for chunk in stream if chunk.choices)
    assert content.strip(), up.diagnostics()

    # The banner says where every process serves /metrics, and each does.
    metrics = dict((name, u) for u, name in
                   re.findall(r"(http://\S+/metrics)  \((\S+)\)", out))
    assert set(metrics) == {"edge", "dispatcher", "worker-1"}, out
    for name, metrics_url in metrics.items():
        with urllib.request.urlopen(metrics_url, timeout=5) as response:
            text = response.read().decode()
        assert "target_info" in text, (name, text)
    assert f":{up.port}/" not in metrics["edge"]
    # Not on the API port, where it would need no key.
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(f"http://127.0.0.1:{up.port}/metrics", timeout=5).close()
    info.value.close()
    assert info.value.code == 404
    with urllib.request.urlopen(metrics["worker-1"], timeout=5) as response:
        assert "tidegate_worker_slots" in response.read().decode()
    # The console the banner names answers (its API needs an admin key).
    console = re.search(r"Console:  (http://\S+/console)", out)
    assert console is not None, out
    with urllib.request.urlopen(console.group(1), timeout=5) as response:
        assert "tidegate console" in response.read().decode()
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(urllib.request.Request(
            console.group(1) + "/api/status", headers={"Authorization": f"Bearer {DEV_KEY}"}),
            timeout=5).close()
    denied.value.close()
    assert denied.value.code == 403

    # nats, redis, dispatcher, one worker, edge, console; each its own process.
    assert len(up.children) >= 6, up.children
    assert (up.data_dir / "tidegate.toml").exists()
    effective = tgconfig.load(up.data_dir / "tidegate.toml", {})
    assert (effective.edge.port, effective.auth.dev_key) == (up.port, DEV_KEY)
    # The embedded NATS runs with per-tier users by default (docs/security.md):
    # the stream above crossed it without one permissions violation, the
    # admin CLI gets in with the admin login, and no login gets nothing.
    assert effective.nats.credentials.endswith("{tier}.creds.toml")
    nats_log = (up.data_dir / "logs" / "nats.log").read_text()
    assert "Violation" not in nats_log, nats_log[-2000:]
    keys = subprocess.run([sys.executable, "-m", "fleet", "keys", "list", "--config",
                           str(up.data_dir / "tidegate.toml")], capture_output=True, text=True,
                          timeout=30)
    assert keys.returncode == 0, keys.stderr
    anonymous = subprocess.run(
        [sys.executable, "-m", "fleet", "keys", "list", "--config",
         str(up.data_dir / "tidegate.toml")], capture_output=True, text=True, timeout=30,
        env={**os.environ, "TIDEGATE__NATS__CREDENTIALS": ""})
    assert anonymous.returncode != 0
    assert "Authorization" in anonymous.stderr, anonymous.stderr
    # tidegate up ran setup as admin: the tiers' logins only bound to it.
    assert "setup: creating or updating" in up.stderr_path.read_text(), up.diagnostics()
    # No NATS monitoring port (it lists users to anyone), and Redis needs the
    # password the tiers got in their config.
    argv = (up.data_dir / "logs" / "nats.log").read_text().split("starting: ", 1)[1]
    assert " -m " not in argv.splitlines()[0], argv.splitlines()[0]
    redis_port = int(effective.redis.url.rsplit(":", 1)[1].split("/")[0])
    with socket.create_connection(("127.0.0.1", redis_port), timeout=5) as conn:
        conn.sendall(b"PING\r\n")
        assert conn.recv(64).startswith(b"-NOAUTH")
    assert "@" in effective.redis.url

    up.proc.send_signal(signal.SIGTERM)
    try:  # bounded by each wave's own timeout, which a loaded box may need
        code = up.proc.wait(timeout=180)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidegate up did not stop on SIGTERM\n{up.diagnostics()}")
    assert (code, "did not stop" in up.stderr_path.read_text()) == (0, False), up.diagnostics()
    left = [c for c in up.children if is_alive(c)]
    assert not left, f"processes left behind: {left}\n{up.diagnostics()}"
    assert wait_until(lambda: port_is_free(up.port), 5), "edge port still taken"
    assert "did not stop" not in up.stderr_path.read_text(), up.diagnostics()


@pytest.mark.pipeline
@pytest.mark.timeout(480)
def test_up_stops_everything_when_a_child_dies(start_up: Callable[..., Up]) -> None:
    # --crash-limit 1: the first exit is a crash loop (else a restart: test_supervisor.py).
    up = start_up("--workers", "2", "--crash-limit", "1")
    up.wait_url()
    assert len(up.children) >= 6  # nats, redis, dispatcher, 2 workers, edge
    os.kill(_child_running(up, "dispatcher"), signal.SIGKILL)
    # Bounds no loaded box misses: the stop announced, then each wave's own timeout.
    assert wait_until(lambda: "stopping everything" in up.stderr_path.read_text(), 120), \
        f"tidegate up ignored a dead child\n{up.diagnostics()}"
    try:
        code = up.proc.wait(timeout=300)  # the waves' timeouts (edge 35 s, workers 65 s...)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tidegate up did not finish stopping\n{up.diagnostics()}")
    err = up.stderr_path.read_text()
    assert (code, "dispatcher exited 1 time within 60s" in err) == (1, True), err
    assert "dispatcher.log" in err  # the log tail is shown
    assert "did not stop" not in err, up.diagnostics()  # every child stopped on SIGTERM
    assert wait_until(lambda: not any(is_alive(c) for c in up.children), 10), up.diagnostics()
    assert port_is_free(up.port)


@pytest.mark.pipeline
def test_second_signal_kills_at_once(start_up: Callable[..., Up], tmp_path: Path) -> None:
    """A stream that outlives the signals keeps the graceful stop waiting (the edge drains
    up to 60 s, the rest up to a minute each); a second Ctrl-C ends everything far sooner."""
    config = tmp_path / "slow.toml"
    config.write_text(
        "[edge]\nshutdown_timeout = 60.0\n[worker]\nshutdown_timeout = 60.0\n"
        "[[models]]\nname = \"tidegate-sim\"\n"
        "[models.simulator]\nttft = 0.0\ntokens_per_second = 5.0\nlength = 2000\n")
    up = start_up("--config", str(config))
    url = up.wait_url()
    req = urllib.request.Request(
        f"{url}/chat/completions", method="POST",
        data=json.dumps({"model": "tidegate-sim", "stream": True,
                         "messages": [{"role": "user", "content": "long"}]}).encode(),
        headers={"Authorization": f"Bearer {DEV_KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as response:
        assert response.readline().startswith(b"data: "), "the stream is open"
        up.proc.send_signal(signal.SIGINT)
        # The graceful stop is under way (the edge drains: not ready, then
        # closed) and held by the open stream: up is still running.
        ready = f"http://127.0.0.1:{up.port}/readyz"
        assert wait_until(lambda: not http_ok(ready), 15), up.diagnostics()
        assert up.proc.poll() is None, "the graceful stop did not wait for the open stream"
        up.proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        try:
            up.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"tidegate up ignored the second signal\n{up.diagnostics()}")
    took = time.monotonic() - second
    assert took < 15, f"exited {took:.1f}s after the second signal"
    assert wait_until(lambda: not any(is_alive(c) for c in up.children), 10), up.diagnostics()
    assert port_is_free(up.port)


@pytest.mark.pipeline
def test_up_stops_the_edge_first_then_workers_dispatcher_redis_nats(up: Up) -> None:
    """README: Ctrl-C stops the edge first (so open streams can finish), then
    workers, dispatcher, Redis, NATS. Each child's exit is watched in /proc."""
    up.wait_url()
    order = {"edge": _child_running(up, "edge"), "worker": _child_running(up, "worker"),
             "dispatcher": _child_running(up, "dispatcher"),
             "redis": _child_named(up, b"redis-server"), "nats": _child_named(up, b"nats-server")}
    identities = {name: proc_identity(pid) for name, pid in order.items()}
    gone: dict[str, float] = {}
    up.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while len(gone) < len(order) and time.monotonic() < deadline:
        for name, identity in identities.items():
            if name not in gone and (identity is None or not is_alive(identity)):
                gone[name] = time.monotonic()
        time.sleep(0.005)
    assert up.proc.wait(timeout=30) == 0, up.diagnostics()
    assert len(gone) == len(order), (gone, up.diagnostics())
    assert sorted(gone, key=gone.__getitem__) == [
        "edge", "worker", "dispatcher", "redis", "nats"], gone


def _child_named(up: Up, binary: bytes) -> int:
    for pid, _start in up.children:
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        except FileNotFoundError:
            continue
        if binary in argv0:  # redis-server rewrites its title ("redis-server 127.0.0.1:N")
            return pid
    pytest.fail(f"no {binary.decode()} child among {up.children}")


def _child_running(up: Up, tier: str) -> int:
    for pid, _start in up.children:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if b"fleet" in argv and tier.encode() in argv:
            return pid
    pytest.fail(f"no {tier} child among {up.children}")


@pytest.fixture
def fake_backend_process(tmp_path: Path) -> Iterator[str]:
    """The fake OpenAI-compatible server as its own process, as vLLM would be."""
    port = free_port()
    log = open(tmp_path / "fake-backend.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.fake_backend", "--port", str(port),
         "--model", "acme/llama-fake:8b", "--tokens", "12", "--itl", "0.001"],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        assert wait_until(lambda: http_ok(f"{url}/models"), 15), "fake backend did not start"
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.mark.pipeline
def test_up_fronts_a_running_openai_compatible_server(
        start_up: Callable[..., Up], fake_backend_process: str) -> None:
    up = start_up("--backend", fake_backend_process)
    url = up.wait_url()
    assert "acme/llama-fake:8b" in up.output()
    client = openai.OpenAI(base_url=url, api_key=DEV_KEY, max_retries=0, timeout=30)
    with client:
        assert [m.id for m in client.models.list()] == ["acme/llama-fake:8b"]
        with client.chat.completions.create(
                model="acme/llama-fake:8b", stream=True, max_tokens=5,
                messages=[{"role": "user", "content": "hi"}]) as stream:
            content = "".join(chunk.choices[0].delta.content or ""
                              for chunk in stream if chunk.choices)
    assert content, up.diagnostics()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(timeout=180) == 0, up.diagnostics()  # the waves' own timeouts


@pytest.mark.pipeline
@pytest.mark.slow
def test_up_runs_setup_again_after_restarting_nats(up: Up) -> None:
    """A restarted NATS has lost the memory-stored buckets the tiers may not
    create: the launcher runs setup as admin again (awaited by its "setup:
    done": its first line is too soon for the lookup), and the stack serves."""
    from fleet.run.supervisor import read_state

    url = up.wait_url()
    config = up.data_dir / "tidegate.toml"
    state = read_state(up.data_dir)
    assert state is not None
    (nats_pid,) = [p["pid"] for p in state["processes"] if p["name"] == "nats"]
    os.kill(nats_pid, signal.SIGKILL)
    assert wait_until(lambda: up.stderr_path.read_text().count(
        "setup: done") >= 2, READY_TIMEOUT), up.diagnostics()

    async def workers_bucket_exists() -> bool:
        effective = tgconfig.load(config, {})
        from tidegate.control.admin import connect_once

        nc = await connect_once(effective.nats, "tidegate-admin")
        try:
            await nc.jetstream().key_value(effective.nats.subjects.workers_bucket)
            return True
        finally:
            await nc.close()

    assert asyncio.run(workers_bucket_exists())
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        try:
            with openai.OpenAI(base_url=url, api_key=DEV_KEY, max_retries=0,
                               timeout=30) as client:
                reply = client.chat.completions.create(
                    model="tidegate-sim", max_tokens=4,
                    messages=[{"role": "user", "content": "after the restart"}])
            assert reply.choices[0].message.content
            break
        except openai.APIError:
            assert time.monotonic() < deadline, up.diagnostics()
            time.sleep(0.5)
