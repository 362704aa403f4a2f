"""Configs fail at start, with one line, never per request (issue 43, item 5).

What a tier accepts runs, through a real pipeline; what it refuses it refuses
before serving, with one line naming the key and no traceback. The schema
walk (every key, a bad value and the default) is tests/test_config_schema.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.fake_backend import FakeBackend
from fleet.run.servers import free_port
from tests.pipeline import Pipeline, threaded_fake_backend
from tidegate.telemetry.observability import METRICS_PORT_ENV

MODEL = "fake"


def _tier(*args: str, env: dict[str, str] | None = None,
          timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    return subprocess.run([sys.executable, "-m", "fleet", *args], capture_output=True,
                          text=True, timeout=timeout, env={**base, **(env or {})})


def _one_line_naming(result: subprocess.CompletedProcess[str], key: str) -> None:
    """Refused: a non-zero exit, one error line naming ``key``, no traceback."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "ExceptionGroup" not in result.stderr, result.stderr
    naming = [line for line in result.stderr.splitlines() if key in line]
    assert len(naming) == 1, result.stderr


@pytest.fixture
def fake() -> Iterator[FakeBackend]:
    with threaded_fake_backend(models=[MODEL], ttft=0.01, itl=0.002, tokens=4) as backend:
        yield backend


@pytest.mark.pipeline
def test_a_one_element_base_urls_serves_requests(
        tmp_path: Path, module_nats_url: str, module_redis_url: str, fake: FakeBackend) -> None:
    """``base_urls = ["http://..."]`` is ``base_url = "http://..."``: it once
    passed the check and then failed every request with 400."""
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, overrides={
        "nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]},
        "models": [{"name": MODEL, "backend": "openai", "base_urls": [fake.base_url]}]})
    pipeline.start()  # waits until a request to the model made the round trip
    try:
        status, body = pipeline.post("/v1/chat/completions", {
            "model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": "one replica"}]})
    finally:
        pipeline.stop()
    assert status == 200, (body, pipeline.logs())
    assert json.loads(body)["choices"][0]["message"]["content"]
    assert any("one replica" in json.dumps(r.body) for r in fake.records)
    assert "not an http(s) URL" not in pipeline.log_text()


@pytest.mark.pipeline
def test_a_second_edge_on_a_taken_port_exits_naming_the_key(
        tmp_path: Path, module_nats_url: str, module_redis_url: str) -> None:
    """A second ``tidegate edge`` with the same file: its gRPC port (or its
    API port) is the first's, and it says so in one line."""
    grpc_port = free_port()
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url, workers=0, overrides={
        "nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]},
        "edge": {"grpc_port": grpc_port}})
    pipeline.start()
    try:
        # Its own API and metrics ports: only the gRPC port is taken.
        result = _tier("edge", "--config", str(pipeline.config_path),
                       "--port", str(free_port()), env={METRICS_PORT_ENV: str(free_port())})
        _one_line_naming(result, "edge.grpc_port")
        assert str(grpc_port) in result.stderr
        assert "in use" in result.stderr
        # Its own gRPC port, the first edge's API port.
        result = _tier("edge", "--config", str(pipeline.config_path),
                       env={METRICS_PORT_ENV: str(free_port()),
                            "TIDEGATE__EDGE__GRPC_PORT": str(free_port())})
        _one_line_naming(result, "edge.port")
        assert str(pipeline.port) in result.stderr
        assert pipeline.edge.poll() is None  # the first edge serves on
    finally:
        pipeline.stop()


@pytest.mark.pipeline
def test_metrics_port_0_in_the_environment_means_none(
        tmp_path: Path, module_nats_url: str, module_redis_url: str) -> None:
    """``TIDEGATE_METRICS_PORT=0`` is ``metrics_port = 0``: no metrics server,
    and the tier serves."""
    pipeline = Pipeline(tmp_path, module_nats_url, module_redis_url,
                        env={METRICS_PORT_ENV: "0"}, overrides={
                            "nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]}})
    pipeline.start()  # every tier up, one request served
    try:
        status, _ = pipeline.post("/v1/chat/completions", {
            "model": "sim", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        alive = [p.poll() for p in pipeline.processes]
    finally:
        pipeline.stop()
    assert status == 200, pipeline.logs()
    assert alive == [None] * len(alive), pipeline.logs()
    assert "Traceback" not in pipeline.log_text()


@pytest.mark.exits_at_once
@pytest.mark.parametrize("tier", ["edge", "dispatcher", "worker"])
@pytest.mark.parametrize(("env", "key"), [
    ({METRICS_PORT_ENV: "70000"}, METRICS_PORT_ENV),
    ({METRICS_PORT_ENV: "http"}, METRICS_PORT_ENV),
    ({"TIDEGATE__NATS__CREDENTIALS": "/nonexistent/{tier}.creds.toml"}, "nats.credentials"),
    ({"TIDEGATE__NATS__TLS_CA": "/nonexistent/ca.pem"}, "nats.tls_ca"),
    ({"TIDEGATE__EDGE__PORT": "65536"}, "edge.port"),
])
def test_refused_at_start_in_one_line(tier: str, env: dict[str, str], key: str) -> None:
    """Before any connection: no NATS is needed to be told the config is wrong
    (nats.url points at a port nothing listens on)."""
    dead_nats = f"nats://127.0.0.1:{free_port()}"
    result = _tier(tier, "--nats-url", dead_nats, env=env, timeout=30)
    _one_line_naming(result, key)
    assert result.returncode == 2, result.stderr


@pytest.mark.exits_at_once
def test_a_missing_edge_certificate_is_refused_at_start(tmp_path: Path) -> None:
    result = _tier("edge", "--nats-url", f"nats://127.0.0.1:{free_port()}", env={
        "TIDEGATE__EDGE__TLS_CERT": str(tmp_path / "cert.pem"),
        "TIDEGATE__EDGE__TLS_KEY": str(tmp_path / "key.pem")}, timeout=30)
    _one_line_naming(result, "edge.tls_cert")
    assert result.returncode == 2


@pytest.mark.exits_at_once
def test_an_unreachable_nats_is_waited_for_quietly_and_sigterm_ends_the_wait() -> None:
    """Not refused (tiers start in any order, often before NATS): the tier
    waits, saying so in one line per connection, not one per retry, and the
    first SIGTERM ends the wait. It once logged two lines every 0.5 s and
    needed a second signal."""
    import signal
    import time

    url = f"nats://127.0.0.1:{free_port()}"
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    proc = subprocess.Popen([sys.executable, "-m", "fleet", "dispatcher", "--nats-url", url],
                            env={**base, METRICS_PORT_ENV: "0"}, stderr=subprocess.PIPE,
                            text=True)
    try:
        time.sleep(4)  # eight of nats-py's own retries
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=15)
    finally:
        proc.kill()
        proc.wait()
    waiting = [line for line in stderr.splitlines() if f"cannot reach NATS at {url}" in line]
    assert 1 <= len(waiting) <= 2, stderr  # the dispatcher and its queue-stats connection
    assert "second SIGTERM" not in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert len(stderr.splitlines()) <= 6, stderr
