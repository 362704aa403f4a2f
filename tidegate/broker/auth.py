"""How a tier logs in to NATS: per-tier credentials and TLS (docs/security.md).

:func:`connect_options` is the one place turning ``[nats]`` settings into
nats-py ``connect()`` keyword arguments, for the services' reconnecting
client (``tidegate.broker.broker.connect``) and the CLI's one-shot one alike.
"""

from __future__ import annotations

import ssl
import tomllib
from pathlib import Path
from typing import Any

from tidegate.broker.permissions import edge_login, role_of
from tidegate.config import NatsConfig
from tidegate.errors import ConfigError


def credentials_path(cfg: NatsConfig, role: str) -> Path | None:
    if not cfg.credentials:
        return None
    return Path(cfg.credentials.replace("{tier}", role))


def load_credentials(path: Path) -> dict[str, str]:
    """``user``, ``password`` and ``inbox_prefix`` from a credentials file."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"nats.credentials: cannot read {path}: {exc}") from None
    out = {k: raw.get(k) for k in ("user", "password", "inbox_prefix")}
    if not all(isinstance(v, str) and v for v in out.values()):
        raise ConfigError(f"nats.credentials: {path} needs user, password and inbox_prefix")
    return {k: str(v) for k, v in out.items()}


def tls_context(cfg: NatsConfig) -> ssl.SSLContext | None:
    """A client TLS context when the URL is tls:// or a CA is given."""
    if not (cfg.tls_ca or cfg.url.strip().startswith("tls://")):
        return None
    try:
        context = ssl.create_default_context(cafile=cfg.tls_ca or None)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"nats.tls_ca: cannot load {cfg.tls_ca}: {exc}") from None
    if cfg.tls_cert:
        try:
            context.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"nats.tls_cert / nats.tls_key: {exc}") from None
    return context


def _login(cfg: NatsConfig, client_name: str) -> Path | None:
    """The credentials file of this client: an edge's own
    (``edge.<edge id>``) when there is one, else its tier's."""
    role = role_of(client_name)
    edge_id = (client_name.removeprefix("tidegate-edge-")
               if role == "edge" and client_name.startswith("tidegate-edge-") else "")
    own = credentials_path(cfg, edge_login(edge_id)) if edge_id else None
    if own is not None and own.exists():
        return own
    shared = credentials_path(cfg, role)
    if own is not None and shared is not None and not shared.exists():
        raise ConfigError(f"nats.credentials: no login for edge {edge_id!r}: neither {own} "
                          f"nor {shared} exists (edge.edge_id must be one of the ids given "
                          f"to `tidegate nats-config --edges`)")
    return shared


def connect_options(cfg: NatsConfig, client_name: str) -> dict[str, Any]:
    """Login and TLS keyword arguments for ``nats.connect`` for this client."""
    options: dict[str, Any] = {}
    path = _login(cfg, client_name)
    if path is not None:
        creds = load_credentials(path)
        options.update(user=creds["user"], password=creds["password"],
                       inbox_prefix=creds["inbox_prefix"])
    tls = tls_context(cfg)
    if tls is not None:
        options["tls"] = tls
    return options
