"""``tidegate nats-config``: write nats-server's authorization and per-tier logins.

Writes into one directory:

* ``auth.conf`` - an ``authorization`` block for nats-server (``include`` it in
  your server config, or pass it with ``-c``), one user per tier with the
  permissions of :mod:`tidegate.broker.permissions`;
* ``<tier>.creds.toml`` for edge, dispatcher, worker and admin (mode 0600) -
  point ``nats.credentials`` at ``<dir>/{tier}.creds.toml`` and each process
  picks its own; with edge ids, ``edge.<id>.creds.toml`` per edge instead of
  the edges' shared login (each reads only its own replies).

Existing credentials are kept unless ``rotate`` is set (a running server
keeps working); the permissions are always rewritten from the current table.
"""

from __future__ import annotations

import os
from pathlib import Path

from tidegate.broker.auth import load_credentials
from tidegate.broker.permissions import Credentials, new_credentials, server_config
from tidegate.errors import ConfigError
from tidegate.wire.subjects import Subjects

AUTH_FILE = "auth.conf"


def creds_file(directory: Path, role: str) -> Path:
    return directory / f"{role}.creds.toml"


def credentials_setting(directory: Path) -> str:
    """The ``nats.credentials`` value for files written into ``directory``."""
    return str(directory.resolve() / "{tier}.creds.toml")


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode otherwise


def write(directory: Path, subjects: Subjects, *, rotate: bool = False,
          edges: tuple[str, ...] = ()) -> Path:
    """Write ``auth.conf`` and the credentials; returns the auth.conf path.
    ``edges``: an own login per edge id (and no shared edge login)."""
    directory.mkdir(parents=True, exist_ok=True)
    creds: dict[str, Credentials] = {}
    for name, fresh in new_credentials(edges).items():
        path = creds_file(directory, name)
        if path.exists() and not rotate:
            try:
                old = load_credentials(path)
            except ConfigError:
                old = None
            if old is not None:
                creds[name] = Credentials(fresh.role, old["user"], old["password"],
                                          fresh.edge_id)
                continue
        creds[name] = fresh
        _write_private(path, fresh.to_toml())
    if edges:
        # A shared edge login left from before would no longer log in.
        creds_file(directory, "edge").unlink(missing_ok=True)
    auth = directory / AUTH_FILE
    _write_private(auth, server_config(subjects, creds))
    return auth
