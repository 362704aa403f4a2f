"""The settings tidegate gives the nats-servers it starts (``NatsServer``):
JetStream fsyncs before it acknowledges (``sync_interval: always``: nothing
acknowledged is lost when every node loses power at once), and the server
pings its idle clients every 2 s, so a client cut off without a word (a
partition, a host gone) loses its subscriptions in about 6 s, not nats-server's
default 4 minutes: until then a cut worker's control subject still has a
subscriber, and the edges' liveness probe (tidegate.broker.liveness) takes it
for alive. A worker stalled for less (a long pause of its loop) keeps its
jobs. docs/reliability.md, "Durability" and "Partitions".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CLIENT_PING", "CLIENT_PING_MAX", "ROUTE_PING", "SETTINGS_CONF", "SYNC_ALWAYS",
           "with_server_settings"]

SYNC_ALWAYS = "always"
# The server's ping of each idle client, and the pings unanswered before it
# drops the connection (at the third ping: about 6 s of silence). At 1 s a
# worker stopped for 4 s was taken for gone and its only stream ended
# (tests/test_failover.py::test_a_stopped_worker_is_slow_not_dead).
CLIENT_PING = "2s"
CLIENT_PING_MAX = 2
# The top-level ping_interval applies to routes too: at 2 s a node cut from
# its peers dropped its routes within 6 s instead of riding the cut out, and
# the cluster did not serve again within 10 s of the heal (CI:
# test_partition_under_load[nats-meta-leader-cut]). Routes keep nats-server's
# own default, set in the cluster block.
ROUTE_PING = "2m"
SETTINGS_CONF = "tidegate-server.conf"


def with_server_settings(data_dir: Path, extra_args: Sequence[str], *,
                         sync_interval: str | None, ping_interval: str | None) -> list[str]:
    """``extra_args`` with a ``-c`` config that sets JetStream's sync_interval
    and the server's client pings (each left to nats-server when None).

    nats-server takes one ``-c`` and has no flag for either, so the written
    config includes the caller's own ``-c`` file (by a relative path:
    nats-server joins an include to the including file's directory, absolute
    or not).
    """
    args = list(extra_args)
    lines = []
    if sync_interval is not None:
        lines.append(f"jetstream {{ sync_interval: {sync_interval} }}")
    if ping_interval is not None:
        lines += [f'ping_interval: "{ping_interval}"', f"ping_max: {CLIENT_PING_MAX}"]
        if "--cluster" in args:
            # Clustered by flags (fleet.run.clusters), so no cluster block
            # of the caller's is replaced: the flags fill this one in.
            lines.append(f'cluster {{ ping_interval: "{ROUTE_PING}" }}')
    if not lines:
        return args
    if "-c" in args:
        at = args.index("-c")
        own = Path(args[at + 1]).resolve()
        del args[at:at + 2]
        lines.insert(0, f'include "{os.path.relpath(own, data_dir.resolve())}"')
    conf = data_dir / SETTINGS_CONF
    conf.write_text("\n".join(lines) + "\n")
    return [*args, "-c", str(conf)]
