"""The tidegate command line: config printing, error contract, version."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fleet.cli import build_parser, main
from tidegate import config as tgconfig

pytestmark = pytest.mark.usefixtures("clean_env")


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    return subprocess.run([sys.executable, "-m", "fleet", *args], capture_output=True,
                          text=True, timeout=60, env={**base, **(env or {})})


def test_config_prints_valid_toml_of_the_effective_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[edge]\nport = 9001\n")
    result = _run("config", "--config", str(path), "--nats-url", "nats://10.0.0.1:4222",
                  env={"TIDEGATE__LOGGING__JSON": "true"})
    assert result.returncode == 0, result.stderr
    parsed = tomllib.loads(result.stdout)
    config = tgconfig.from_dict(parsed)
    assert config.edge.port == 9001  # file
    assert config.logging.json is True  # environment
    assert config.nats.url == "nats://10.0.0.1:4222"  # flag
    assert config == tgconfig.load(path, {"TIDEGATE__LOGGING__JSON": "true"},
                                   {"nats": {"url": "nats://10.0.0.1:4222"}})


def test_config_defaults_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    assert tgconfig.from_dict(tomllib.loads(capsys.readouterr().out)) == tgconfig.Config()


@pytest.mark.parametrize(("toml", "key"), [
    ("[edge]\nport = 70000\n", "edge.port"),
    ("[edge]\nprot = 1\n", "prot"),
    ('[[models]]\nname = "a"\nbackend = "openai"\n', "models[0].base_url"),
    ("[edge\n", "not valid TOML"),
])
def test_bad_config_exits_2_naming_the_key(tmp_path: Path, toml: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    result = _run("config", "--config", str(path))
    assert result.returncode == 2
    assert key in result.stderr
    assert result.stderr.startswith("tidegate: error: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


def test_bad_env_and_flags_exit_2(tmp_path: Path) -> None:
    result = _run("config", env={"TIDEGATE__EDGE__PORT": "-1"})
    assert (result.returncode, "edge.port" in result.stderr) == (2, True), result.stderr
    result = _run("config", "--redis-url", "http://nope")
    assert (result.returncode, "redis.url" in result.stderr) == (2, True), result.stderr
    result = _run("config", "--config", str(tmp_path / "missing.toml"))
    assert (result.returncode, "does not exist" in result.stderr) == (2, True), result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.exits_at_once
def test_tier_with_bad_config_exits_2_without_traceback() -> None:
    result = _run("edge", "--port", "99999")
    assert result.returncode == 2
    assert "edge.port" in result.stderr
    assert "Traceback" not in result.stderr
    result = _run("worker", "--model", "no-such-model")
    assert result.returncode == 2
    assert "no-such-model" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.exits_at_once
def test_up_with_taken_port_fails_clearly(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = _run("up", "--port", str(port), "--data-dir", str(tmp_path))
    assert result.returncode == 1
    assert f"port {port}" in result.stderr
    assert "in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert capsys.readouterr().out.startswith("tidegate 0.")
    assert _run("version").stdout.startswith("tidegate ")


def test_flags_become_overrides() -> None:
    from fleet.cli.common import _overrides

    args = build_parser().parse_args(
        ["edge", "--host", "0.0.0.0", "--port", "9000", "--nats-url", "nats://n:1"])
    assert _overrides(args) == {"edge": {"host": "0.0.0.0", "port": 9000},
                                "nats": {"url": "nats://n:1"}}
    args = build_parser().parse_args(["worker", "--model", "a", "--model", "b"])
    assert _overrides(args) == {"worker": {"models": ["a", "b"]}}


def test_missing_subcommand_is_a_usage_error() -> None:
    result = _run()
    assert result.returncode == 2
    assert "usage:" in result.stderr
