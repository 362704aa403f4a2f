"""Typed configuration: one TOML file plus environment overrides, validated once.

Every component gets a frozen dataclass; nothing reads the environment or a
dict after :func:`load` returns. Unknown keys are errors, and every message
names the key (``models[1].max_streams: must be >= 1, got 0``).

Precedence: built-in defaults < TOML file < environment (``TIDEGATE_CONFIG``,
``TIDEGATE_NATS_URL``, ``TIDEGATE_REDIS_URL``, ``TIDEGATE_DEV_KEY`` and
``TIDEGATE__<SECTION>__<KEY>=<value>``, read as a TOML value when it parses
as one). Docs: docs/configuration.md#where-values-come-from.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from tidegate.config.check import check_values
from tidegate.config.sections import (
    DEFAULT_FAILOVER,
    DEFAULT_MAX_OUTPUT_TOKENS,
    AffinityMode,
    AuthConfig,
    BackendKind,
    BatchConfig,
    Config,
    DispatcherConfig,
    EdgeConfig,
    GrpcConfig,
    LoggingConfig,
    ModelConfig,
    NatsConfig,
    QueueModeConfig,
    QuotaFailure,
    RedisConfig,
    ResumeConfig,
    RoutingConfig,
    SessionConfig,
    SimulatorConfig,
    SpendConfig,
    StorageKind,
    StreamLimit,
    StreamsConfig,
    TierConfig,
    WorkerConfig,
    WsConfig,
    replica_name,
)
from tidegate.errors import ConfigError

# The section dataclasses live in tidegate.config.sections and validation in
# tidegate.config.check; import the dataclasses from here.
__all__ = [
    "DEFAULT_FAILOVER", "DEFAULT_MAX_OUTPUT_TOKENS", "AffinityMode", "AuthConfig", "BackendKind",
    "BatchConfig", "Config", "DispatcherConfig",
    "EdgeConfig", "GrpcConfig", "LoggingConfig", "ModelConfig", "NatsConfig", "QueueModeConfig",
    "QuotaFailure", "RedisConfig", "ResumeConfig", "RoutingConfig", "SessionConfig",
    "SimulatorConfig", "SpendConfig", "StorageKind", "StreamLimit", "StreamsConfig", "TierConfig",
    "WorkerConfig", "WsConfig", "dump_toml", "from_dict", "load", "replica_name",
]


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def load(path: str | os.PathLike[str] | None = None,
         env: Mapping[str, str] | None = None,
         overrides: Mapping[str, Any] | None = None) -> Config:
    """Build the config from defaults, the TOML file, the environment and
    ``overrides`` (a nested dict, e.g. from CLI flags), in that order."""
    env = os.environ if env is None else env
    path = path or env.get("TIDEGATE_CONFIG") or None
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    _merge(raw, _env_overrides(env))
    if overrides:
        _merge(raw, dict(overrides))
    return from_dict(raw)


def from_dict(raw: Mapping[str, Any]) -> Config:
    config: Config = _build(Config, raw, "")
    check_values(config)
    return config


def dump_toml(config: Config) -> str:
    """Serialise a config back to TOML (used by the launcher to hand the exact
    effective config to its child processes)."""
    lines: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in ("models", "tiers"):
            continue
        lines.append(f"[{f.name}]")
        lines.extend(_toml_items(value))
        lines.append("")
    for model in config.models:
        lines.append("[[models]]")
        lines.extend(_toml_items(model, skip=("simulator", "queue")))
        lines.append("[models.simulator]")
        lines.extend(_toml_items(model.simulator))
        lines.append("[models.queue]")
        lines.extend(_toml_items(model.queue))
        lines.append("")
    for tier in config.tiers:
        lines.append("[[tiers]]")
        lines.extend(_toml_items(tier))
        lines.append("")
    return "\n".join(lines)


def _toml_items(obj: Any, skip: tuple[str, ...] = ()) -> list[str]:
    return [f"{f.name} = {_toml_value(getattr(obj, f.name))}"
            for f in dataclasses.fields(obj) if f.name not in skip]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return _toml_str(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def _toml_str(s: str) -> str:
    escaped = s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


_ENV_SHORTCUTS = {
    "TIDEGATE_NATS_URL": ("nats", "url"),
    "TIDEGATE_REDIS_URL": ("redis", "url"),
    "TIDEGATE_DEV_KEY": ("auth", "dev_key"),
}


def _env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (section, key) in _ENV_SHORTCUTS.items():
        if env.get(name):
            out.setdefault(section, {})[key] = env[name]
    for name, value in env.items():
        if not name.startswith("TIDEGATE__"):
            continue
        parts = name[len("TIDEGATE__"):].lower().split("__")
        if len(parts) != 2 or not all(parts):
            raise ConfigError(f"environment variable {name}: expected TIDEGATE__<SECTION>__<KEY>")
        section, key = parts
        out.setdefault(section, {})[key] = _parse_env_value(value)
    return out


def _parse_env_value(value: str) -> Any:
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _build(cls: type[Any], raw: Any, path: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a table, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}unknown key {unknown[0]!r} (known: {', '.join(sorted(names))})")
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{_join(path, f.name)}: required")
            continue
        kwargs[f.name] = _coerce(hints[f.name], raw[f.name], _join(path, f.name))
    return cls(**kwargs)


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)  # type: ignore[arg-type]
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{path}: must be one of {', '.join(map(repr, allowed))}, "
                              f"got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_coerce(item_tp, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (types.UnionType, typing.Union):
        # e.g. int | Literal["auto"]: the first member that takes the value.
        members = [t for t in typing.get_args(tp) if t is not type(None)]
        for member in members:
            try:
                return _coerce(member, value, path)
            except ConfigError:
                continue
        expected = " or ".join(_describe(m) for m in members)
        raise ConfigError(f"{path}: expected {expected}, got {value!r}")
    if tp is bool:
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp!r} at {path}")


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, repr(tp))
