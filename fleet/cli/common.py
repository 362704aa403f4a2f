"""The flags every ``tidegate`` command shares (``--config``, ``--nats-url``,
``--redis-url``), the config they load, and the ``config`` and ``nats-config``
commands."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

from tidegate import config as tgconfig
from tidegate.config import Config
from tidegate.errors import ConfigError

# An edge id is a NATS subject token (tidegate.config.check).
_EDGE_ID = re.compile(r"[A-Za-z0-9_-]+")


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH",
                   help="TOML config file (default: $TIDEGATE_CONFIG, else built-in defaults)")
    p.add_argument("--nats-url", metavar="URL", help="NATS server URL(s), comma-separated")
    p.add_argument("--redis-url", metavar="URL", help="Redis URL for quotas")


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if getattr(args, "nats_url", None):
        out["nats"] = {"url": args.nats_url}
    if getattr(args, "redis_url", None):
        out["redis"] = {"url": args.redis_url}
    edge: dict[str, Any] = {}
    if getattr(args, "host", None):
        edge["host"] = args.host
    if getattr(args, "port", None) is not None:
        edge["port"] = args.port
    if edge:
        out["edge"] = edge
    if getattr(args, "model", None) and args.command == "worker":
        # Validated by config: every name must be a configured model or alias.
        out["worker"] = {"models": list(args.model)}
    return out


def load_config(args: argparse.Namespace) -> Config:
    return tgconfig.load(args.config, None, _overrides(args))


_URL_PASSWORD = re.compile(r"(://[^:/@,\s]*:)[^@/,\s]+@")


def redacted(config: Config) -> Config:
    """The config with its secrets replaced, for printing: API keys, and
    passwords inside NATS / Redis URLs. Backend keys are never in the config
    at all (models[].api_key_env names the variable that holds one)."""
    def url(value: str) -> str:
        return _URL_PASSWORD.sub(r"\1<redacted>@", value)

    auth = dataclasses.replace(
        config.auth, keys=tuple("<redacted>" for _ in config.auth.keys),
        dev_key="<redacted>" if config.auth.dev_key else "")
    return dataclasses.replace(
        config, auth=auth, nats=dataclasses.replace(config.nats, url=url(config.nats.url)),
        redis=dataclasses.replace(config.redis, url=url(config.redis.url)))


def cmd_config(args: argparse.Namespace) -> int:
    config = redacted(load_config(args))  # an invalid config prints nothing
    sys.stdout.write("# secrets (API keys, URL passwords) redacted\n")
    sys.stdout.write(tgconfig.dump_toml(config))
    sys.stdout.flush()
    return 0


def cmd_nats_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tidegate.broker import natsconfig

    config = load_config(args)
    out = Path(args.out)
    edges = tuple(e.strip() for e in args.edges.split(",") if e.strip())
    bad = [e for e in edges if not _EDGE_ID.fullmatch(e)]
    if bad or len(set(edges)) != len(edges):
        raise ConfigError(f"--edges: distinct edge ids of letters, digits, '-' and '_', "
                          f"got {args.edges!r}")
    auth = natsconfig.write(out, config.nats.subjects, rotate=args.rotate, edges=edges)
    logins = ", ".join((*(f"edge.{e}" for e in edges), "dispatcher", "worker", "admin")
                       if edges else ("edge", "dispatcher", "worker", "admin"))
    print(f"wrote {auth} and {out}/<name>.creds.toml ({logins})")
    print(f"  nats-server: -c {auth} (or include it in your server config)")
    print(f'  tidegate:    [nats] credentials = "{natsconfig.credentials_setting(out)}"')
    if edges:
        print("  each edge:   [edge] edge_id = one of " + ", ".join(edges))
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    from tidegate.control import provision

    config = load_config(args)
    done = provision.setup(config)
    print(f"tidegate setup: {', '.join(done)} ready for prefix {config.nats.subject_prefix} "
          f"at {redacted(config).nats.url}")
    return 0
