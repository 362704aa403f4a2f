"""Every config file in examples/ loads, validates and says what its comments say."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tidegate import config as tgconfig

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
FILES = sorted(EXAMPLES.glob("*.toml"))


def _load(name: str) -> tgconfig.Config:
    return tgconfig.load(EXAMPLES / name, env={})


def test_examples_exist() -> None:
    assert {p.name for p in FILES} >= {"simulator.toml", "vllm.toml", "ollama.toml",
                                       "llamacpp.toml"}


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_loads(path: Path) -> None:
    config = tgconfig.load(path, env={})
    assert config.models
    # Round trip through the launcher's serialisation: what `tidegate up` hands
    # its children must load to the same config.
    assert tgconfig.from_dict(tomllib.loads(tgconfig.dump_toml(config))) == config


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_leaves_broker_urls_to_tidegate_up(path: Path) -> None:
    # `tidegate up` starts its embedded NATS/Redis only when no URL is
    # configured; an example that set one would silently need an external server.
    raw = tomllib.loads(path.read_text())
    assert "url" not in raw.get("nats", {})
    assert "url" not in raw.get("redis", {})


def test_simulator() -> None:
    config = _load("simulator.toml")
    model = config.model_index()["sim"]
    assert model.name == "tidegate-sim"
    assert model.backend == "simulator"
    assert model.simulator.tokens_per_second == 50.0
    assert config.edge.port == 8080


def test_vllm() -> None:
    config = _load("vllm.toml")
    model = config.model_index()["llama-3.1-8b"]
    assert model.backend == "openai"
    assert model.base_url == "http://127.0.0.1:8000/v1"
    assert model.backend_model == "meta-llama/Llama-3.1-8B-Instruct"
    assert model.api_key_env == ""


def test_ollama() -> None:
    config = _load("ollama.toml")
    model = config.model_index()["llama3.2"]
    assert model.base_url == "http://127.0.0.1:11434/v1"
    assert model.backend_model == "llama3.2"
    assert model.max_streams == 4


def test_llamacpp() -> None:
    config = _load("llamacpp.toml")
    (model,) = config.models
    assert model.base_url == "http://127.0.0.1:8080/v1"
    # llama-server holds 8080, so the edge must listen elsewhere.
    assert config.edge.port == 8090
    assert model.max_streams == 4


def test_full_example_in_the_docs_loads_and_has_every_key() -> None:
    # docs/configuration.md promises "every key"; a key added to the config
    # dataclasses without its line there fails here.
    doc = (EXAMPLES.parent / "docs" / "configuration.md").read_text()
    block = doc.split("## Full example", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    raw = tomllib.loads(block)
    tgconfig.from_dict(raw)

    def missing(cls: Any, tables: list[dict[str, Any]], path: str) -> list[str]:
        return [path + f.name for f in dataclasses.fields(cls)
                if not any(f.name in t for t in tables)]

    gaps = []
    defaults = tgconfig.Config()
    for section in dataclasses.fields(tgconfig.Config):
        if section.name not in ("models", "tiers"):
            gaps += missing(type(getattr(defaults, section.name)), [raw.get(section.name, {})],
                            f"{section.name}.")
    models = raw.get("models", [])
    gaps += missing(tgconfig.ModelConfig, models, "models.")
    gaps += missing(tgconfig.TierConfig, raw.get("tiers", []), "tiers.")
    for sub, cls in (("simulator", tgconfig.SimulatorConfig), ("queue", tgconfig.QueueModeConfig)):
        gaps += missing(cls, [m[sub] for m in models if sub in m], f"models.{sub}.")
    assert not gaps, f"keys missing from the full example in docs/configuration.md: {gaps}"
