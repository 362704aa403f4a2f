"""JetStream's fsync policy for the nats-servers tidegate starts
(``NatsServer(sync_interval=...)``): ``always`` by default, so nothing is
acknowledged before it is on disk (docs/reliability.md, "Durability")."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SYNC_ALWAYS", "SYNC_CONF", "with_sync_interval"]

SYNC_ALWAYS = "always"
SYNC_CONF = "tidegate-sync.conf"


def with_sync_interval(data_dir: Path, extra_args: Sequence[str], interval: str) -> list[str]:
    """``extra_args`` with a ``-c`` config that sets JetStream's sync_interval.

    nats-server takes one ``-c`` and has no flag for it, so the written config
    includes the caller's own ``-c`` file (by a relative path: nats-server
    joins an include to the including file's directory, absolute or not).
    """
    args = list(extra_args)
    lines = [f"jetstream {{ sync_interval: {interval} }}"]
    if "-c" in args:
        at = args.index("-c")
        own = Path(args[at + 1]).resolve()
        del args[at:at + 2]
        lines.insert(0, f'include "{os.path.relpath(own, data_dir.resolve())}"')
    conf = data_dir / SYNC_CONF
    conf.write_text("\n".join(lines) + "\n")
    return [*args, "-c", str(conf)]
