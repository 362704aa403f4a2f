"""tidegate.config: defaults, TOML, environment, validation messages, round trip."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tidegate import config as tgconfig
from tidegate.config import Config, ModelConfig, TierConfig
from tidegate.errors import ConfigError

NO_ENV: dict[str, str] = {}


def test_defaults() -> None:
    config = tgconfig.load(None, NO_ENV)
    assert config == Config()
    assert config.edge.port == 8080
    assert config.nats.url.startswith("nats://")
    assert [m.name for m in config.models] == ["tidegate-sim"]
    assert config.model_index()["sim"].name == "tidegate-sim"
    assert config.api_keys() == ()


def test_toml_file(tmp_path: Path) -> None:
    path = tmp_path / "tidegate.toml"
    path.write_text(
        '[edge]\nport = 9001\nhost = "0.0.0.0"\n'
        '[auth]\nkeys = ["k1", "k2"]\ndev_key = "dev"\n'
        '[[models]]\nname = "a"\n'
        '[[models]]\nname = "b/c:1"\nbackend = "openai"\nbase_url = "http://x:1/v1"\n'
        '[models.simulator]\nlength = 3\n')
    config = tgconfig.load(path, NO_ENV)
    assert (config.edge.port, config.edge.host) == (9001, "0.0.0.0")
    assert config.api_keys() == ("k1", "k2", "dev")
    assert [m.name for m in config.models] == ["a", "b/c:1"]
    assert config.models[1].backend == "openai"
    assert config.models[1].simulator.length == 3
    assert config.session == Config().session  # untouched sections keep defaults


def test_config_path_from_env(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[edge]\nport = 9002\n")
    assert tgconfig.load(None, {"TIDEGATE_CONFIG": str(path)}).edge.port == 9002


def test_env_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[edge]\nport = 9001\n[nats]\nurl = "nats://file:1"\n')
    env = {
        "TIDEGATE__EDGE__PORT": "9100",
        "TIDEGATE__LOGGING__JSON": "true",
        "TIDEGATE__AUTH__KEYS": '["a", "b"]',
        "TIDEGATE__SESSION__HEARTBEAT_INTERVAL": "2.5",
        # Must stay below heartbeat_interval x worker_lost_after (validated).
        "TIDEGATE__WORKER__ACK_WAIT": "2",
        "TIDEGATE_NATS_URL": "nats://env:4",
        "TIDEGATE_REDIS_URL": "redis://env:5/1",
        "TIDEGATE_DEV_KEY": "sk-dev",
    }
    config = tgconfig.load(path, env)
    assert config.edge.port == 9100  # env beats file
    assert config.logging.json is True
    assert config.auth.keys == ("a", "b")
    assert config.session.heartbeat_interval == 2.5
    assert config.nats.url == "nats://env:4"
    assert config.redis.url == "redis://env:5/1"
    assert config.auth.dev_key == "sk-dev"


def test_overrides_beat_env() -> None:
    config = tgconfig.load(None, {"TIDEGATE__EDGE__PORT": "9100"}, {"edge": {"port": 9200}})
    assert config.edge.port == 9200


def test_comma_separated_list_from_env() -> None:
    config = tgconfig.load(None, {"TIDEGATE__AUTH__KEYS": "k1, k2"})
    assert config.auth.keys == ("k1", "k2")


@pytest.mark.parametrize(("raw", "key"), [
    ({"edge": {"port": 70000}}, "edge.port"),
    ({"edge": {"port": "eighty"}}, "edge.port"),
    ({"edge": {"host": 1}}, "edge.host"),
    ({"edge": {"shutdown_timeout": 0}}, "edge.shutdown_timeout"),
    ({"session": {"window_msgs": 2}}, "session.window_msgs"),
    ({"session": {"window_bytes": 10}}, "session.window_bytes"),
    ({"streams": {"replicas": 7}}, "streams.replicas"),
    ({"streams": {"storage": "disk"}}, "streams.storage"),
    ({"logging": {"level": "LOUD"}}, "logging.level"),
    ({"logging": {"json": "maybe"}}, "logging.json"),
    ({"nats": {"url": "http://x"}}, "nats.url"),
    ({"nats": {"subject_prefix": "a.b"}}, "nats.subject_prefix"),
    ({"redis": {"url": "nats://x"}}, "redis.url"),
    ({"auth": {"keys": 5}}, "auth.keys"),
    ({"models": []}, "models"),
    ({"models": [{"backend": "simulator"}]}, "models[0].name"),
    ({"models": [{"name": ""}]}, "models[0].name"),
    ({"models": [{"name": "a"}, {"name": "a"}]}, "models[1]"),
    ({"models": [{"name": "a", "aliases": ["x"]}, {"name": "x"}]}, "models[1]"),
    ({"models": [{"name": "a", "backend": "openai"}]}, "models[0].base_url"),
    ({"models": [{"name": "a", "backend": "magic"}]}, "models[0].backend"),
    ({"models": [{"name": "a", "max_streams": 0}]}, "models[0].max_streams"),
    ({"models": [{"name": "a", "max_streams": "lots"}]}, "models[0].max_streams"),
    ({"models": [{"name": "a", "max_streams": True}]}, "models[0].max_streams"),
    ({"models": [{"name": "a", "min_streams": 0}]}, "models[0].min_streams"),
    ({"models": [{"name": "a", "min_streams": 8, "max_streams_limit": 4}]},
     "models[0].max_streams_limit"),
    ({"models": [{"name": "a", "latency_tolerance": 1.0}]}, "models[0].latency_tolerance"),
    ({"models": [{"name": "a", "simulator": {"length": 0}}]}, "models[0].simulator.length"),
    ({"models": [{"name": "a", "simulator": {"ttft": -1}}]}, "models[0].simulator.ttft"),
    ({"models": [{"name": "a", "idle_timeout": 0}]}, "models[0].idle_timeout"),
    ({"worker": {"models": ["nope"]}}, "worker.models[0]"),
])
def test_validation_names_the_key(raw: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        tgconfig.from_dict(raw)
    assert str(info.value).startswith(key), str(info.value)


@pytest.mark.parametrize(("raw", "where", "name"), [
    ({"edge": {"prot": 1}}, "edge", "prot"),
    ({"nope": {}}, "", "nope"),
    ({"models": [{"name": "a", "colour": "red"}]}, "models[0]", "colour"),
    ({"models": [{"name": "a", "simulator": {"speed": 1}}]}, "models[0].simulator", "speed"),
])
def test_unknown_keys_are_rejected(raw: dict[str, Any], where: str, name: str) -> None:
    with pytest.raises(ConfigError) as info:
        tgconfig.from_dict(raw)
    message = str(info.value)
    assert f"unknown key {name!r}" in message
    assert message.startswith(where)


def test_unknown_env_section_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown key 'nosuch'"):
        tgconfig.load(None, {"TIDEGATE__NOSUCH__KEY": "1"})


def test_malformed_env_name_is_rejected() -> None:
    with pytest.raises(ConfigError, match="TIDEGATE__EDGE"):
        tgconfig.load(None, {"TIDEGATE__EDGE": "1"})


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        tgconfig.load(tmp_path / "missing.toml", NO_ENV)
    bad = tmp_path / "bad.toml"
    bad.write_text("[edge\nport = 1\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        tgconfig.load(bad, NO_ENV)


def _exotic() -> Config:
    return dataclasses.replace(
        Config(),
        auth=dataclasses.replace(Config().auth, keys=("a", 'quote"d', "back\\slash"),
                                 dev_key="sk-tg-x"),
        models=(
            ModelConfig(name="tidegate-sim", aliases=("sim", "s")),
            ModelConfig(name="meta-llama/Llama-3.1-8B:q4", backend="openai",
                        base_url="http://127.0.0.1:8000/v1", api_key_env="KEY",
                        upstream_model="llama"),
        ),
        tiers=(TierConfig(name="gold", weight=4.0, tenants=("acme", "b c")),
               TierConfig(name="free", weight=0.25)),
    )


@pytest.mark.parametrize("config", [Config(), _exotic()], ids=["defaults", "exotic"])
def test_dump_toml_round_trip(config: Config) -> None:
    text = tgconfig.dump_toml(config)
    assert tgconfig.from_dict(tomllib.loads(text)) == config


def test_dump_toml_round_trip_through_file(tmp_path: Path) -> None:
    path = tmp_path / "out.toml"
    path.write_text(tgconfig.dump_toml(_exotic()))
    assert tgconfig.load(path, NO_ENV) == _exotic()


def test_worker_ack_wait_must_beat_worker_lost_detection() -> None:
    with pytest.raises(ConfigError, match=r"worker\.ack_wait"):
        tgconfig.from_dict({"session": {"heartbeat_interval": 2.0}, "worker": {"ack_wait": 4.0}})
    config = tgconfig.from_dict({"session": {"heartbeat_interval": 2.0},
                                 "worker": {"ack_wait": 3.5}})
    assert config.worker.ack_wait == 3.5


def test_dispatcher_ack_wait_must_beat_admission_timeout() -> None:
    with pytest.raises(ConfigError, match=r"dispatcher\.ack_wait"):
        tgconfig.from_dict({"edge": {"admission_timeout": 5.0}})


def test_max_streams_defaults_to_auto_for_openai_and_64_for_the_simulator() -> None:
    cfg = tgconfig.from_dict({"models": [
        {"name": "a", "backend": "openai", "base_url": "http://x/v1"},
        {"name": "b"},
        {"name": "c", "backend": "openai", "base_url": "http://x/v1", "max_streams": 12},
        {"name": "d", "max_streams": "auto", "min_streams": 2, "max_streams_limit": 50}]})
    a, b, c, d = cfg.models
    assert (a.max_streams, a.adaptive, a.initial_streams, a.streams_ceiling) == (
        "auto", True, 4, 1024)
    assert (b.max_streams, b.adaptive, b.initial_streams, b.streams_ceiling) == (
        64, False, 64, 64)
    assert (c.max_streams, c.adaptive, c.initial_streams) == (12, False, 12)
    assert (d.adaptive, d.initial_streams, d.streams_ceiling) == (True, 2, 50)
    # The launcher hands children the effective config: "auto" survives the round trip.
    again = tgconfig.from_dict(tomllib.loads(tgconfig.dump_toml(cfg)))
    assert [m.max_streams for m in again.models] == ["auto", 64, 12, "auto"]


def test_max_streams_from_the_environment() -> None:
    env = {"TIDEGATE_CONFIG": ""}
    assert tgconfig.load(env=env, overrides={"models": [{"name": "a", "max_streams": "8"}]}
                         ).models[0].max_streams == 8
