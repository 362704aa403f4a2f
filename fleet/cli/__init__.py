"""The ``tidegate`` command: the parser and each command's function.

Each command group has its module: ``fleet.cli.tiers`` (up, edge,
dispatcher, worker), ``fleet.cli.common`` (common flags, config,
nats-config), ``fleet.cli.admin`` (keys, policy, tenant, batches),
``fleet.cli.spend`` (price, budget, usage), ``fleet.cli.tools`` (bench,
chaos, status, console). ``tidegate --help`` lists them; docs/reference/cli.md
is generated from this parser.

Flags become ``overrides`` for :func:`tidegate.config.load`, so they win over
the file and the environment. Tier modules are imported inside their command,
so ``tidegate config`` works where a tier cannot import. Error contract: a
:class:`~tidegate.errors.ConfigError` prints ``tidegate: error: <message>`` and
exits 2, any other :class:`~tidegate.errors.TidegateError` exits 1; never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata

from fleet.cli.admin import admin_parsers, cmd_batches, cmd_keys, cmd_policy, cmd_tenant
from fleet.cli.common import add_common, cmd_config, cmd_nats_config, cmd_setup
from fleet.cli.spend import cmd_budget, cmd_price, cmd_usage, spend_parsers
from fleet.cli.tiers import cmd_dispatcher, cmd_edge, cmd_up, cmd_worker
from fleet.cli.tools import cmd_bench, cmd_chaos, cmd_console, cmd_status
from tidegate.errors import ConfigError, TidegateError

PROG = "tidegate"


def version() -> str:
    try:
        return metadata.version("tidegate")
    except metadata.PackageNotFoundError:  # running from a checkout, not installed
        import tidegate

        return str(getattr(tidegate, "__version__", "unknown"))


# --------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="tidegate: an LLM streaming gateway over NATS JetStream.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", help="run everything on this machine",
                        description="Start an embedded NATS and Redis (unless URLs are given), "
                                    "a dispatcher, workers and an edge; stop them on Ctrl-C.")
    add_common(up)
    up.add_argument("--data-dir", metavar="DIR", default=".tidegate",
                    help="state, logs and the dev key (default: ./.tidegate)")
    up.add_argument("--host", help="edge listen address (default: config edge.host)")
    up.add_argument("--port", type=int, help="edge port (default: config edge.port if free, "
                                             "else any free port)")
    up.add_argument("--workers", type=int, default=1, metavar="N",
                    help="worker processes (default: 1)")
    up.add_argument("--edges", type=int, default=1, metavar="N",
                    help="edge processes, sharing the port with SO_REUSEPORT (default: 1)")
    up.add_argument("--dispatchers", type=int, default=1, metavar="N",
                    help="dispatcher processes (default: 1)")
    up.add_argument("--crash-limit", type=int, default=5, metavar="N",
                    help="a child exiting N times within --crash-window stops everything; "
                         "fewer exits are restarted with backoff (default: 5)")
    up.add_argument("--crash-window", type=float, default=60.0, metavar="SECONDS",
                    help="the window of --crash-limit (default: 60)")
    up.add_argument("--backend", action="append", default=[], metavar="URL",
                    help="OpenAI-compatible server to put tidegate in front of, e.g. "
                         "http://127.0.0.1:8000/v1 (repeatable); its /models are served, and a "
                         "model several backends serve is one model with replicas")
    up.add_argument("--backend-key-env", metavar="VAR",
                    help="environment variable holding the backend's API key")
    up.add_argument("--model", action="append", default=[], metavar="NAME",
                    help="with --backend: serve these model names instead of listing them")
    up.add_argument("--no-nats-auth", action="store_true",
                    help="run the embedded NATS without per-tier users and permissions "
                         "(default: with them, see docs/security.md)")
    up.add_argument("--nats-monitor-port", type=int, metavar="PORT",
                    help="serve the embedded NATS's HTTP monitoring on 127.0.0.1:PORT "
                         "(default: off; it lists users and connections without a login)")
    up.add_argument("--console-port", type=int, metavar="PORT",
                    help="the operator console's port on 127.0.0.1 (default: 8090 if free, "
                         "else any; 0: no console; docs/console.md)")
    up.add_argument("--ready-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long every child may take to become ready (default: 60)")

    edge = sub.add_parser("edge", help="run the edge tier (HTTP, SSE)")
    add_common(edge)
    edge.add_argument("--host", help="listen address")
    edge.add_argument("--port", type=int, help="listen port")

    dispatcher = sub.add_parser("dispatcher", help="run the dispatcher tier")
    add_common(dispatcher)

    worker = sub.add_parser("worker", help="run the worker tier")
    add_common(worker)
    worker.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="serve only this configured model (repeatable; default: all)")

    cfg = sub.add_parser("config", help="print the effective config as TOML",
                         description="Validate the config (file + environment + flags) and "
                                     "print it as TOML; exit 2 if it is invalid.")
    add_common(cfg)

    bench = sub.add_parser("bench", help="run the benchmark suite on this machine",
                           description="Measure tidegate against the fake backend directly "
                                       "and against a plain proxy; see docs/benchmarks.md.")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run of every scenario in under a minute")
    bench.add_argument("--scenarios", default="overhead,idle,cancel,slow-clients,peers",
                       metavar="LIST",
                       help="comma-separated list of overhead (a), idle (b: idle streams), "
                            "cancel (c), slow-clients (d), peers (e: other gateways), "
                            "quota (q: quota check cost), telemetry (t: off, metrics, "
                            "traced), responses (r: Responses API overhead), websocket "
                            "(w: against SSE), grpc (g: against SSE), batch (j: batch "
                            "API), affinity (f: across 4 replicas, on and off), resumable "
                            "(s: CPU per chunk, explicit cancel); the letters work too "
                            "(default: overhead, idle, cancel, slow-clients, peers; the "
                            "others only when named)")
    bench.add_argument("--out", default="bench-results", metavar="DIR",
                       help="results folder (default: ./bench-results)")
    bench.add_argument("--idle-streams", type=int, metavar="N",
                       help="streams held open in scenario b (default: 10000, quick: 100)")
    bench.add_argument("--py-spy", action="store_true",
                       help="profile the edge and worker with py-spy during scenario a")
    bench.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override a key of the benchmarked tidegate's config, e.g. "
                            "worker.fetch_timeout=0.05 (repeatable)")

    chaos = sub.add_parser(
        "chaos", help="streaming load against a local fleet while SIGKILLing its processes",
        description="Runs 3 NATS nodes (R3 streams), Redis, 2 edges (one port), 2 dispatchers "
                    "and 2 workers on this machine, streams chat completions through them and "
                    "SIGKILLs a random process of a random kind every few seconds (restarting "
                    "it; with --backends, backend replicas too). Prints every request's class "
                    "(complete, clean error, connection lost, silent truncation, hang); exit 1 "
                    "on any truncation or hang.")
    chaos.add_argument("--duration", type=float, default=60.0, metavar="SECONDS",
                       help="how long the load and the kills run (default: 60)")
    chaos.add_argument("--concurrency", type=int, default=8, metavar="N",
                       help="streaming clients (default: 8)")
    chaos.add_argument("--seed", type=int, default=1, help="seed of the kill schedule")
    chaos.add_argument("--out", metavar="FILE", help="also write the JSON report here")
    chaos.add_argument("--backends", type=int, default=0, metavar="N",
                       help="serve the model from N replicas of the bench's fake OpenAI "
                            "server (processes, killed too) instead of the in-worker "
                            "simulator (default: 0)")
    chaos.add_argument("--workdir", metavar="DIR",
                       help="keep the fleet's state and logs here (logs/<process>.log) "
                            "instead of a temporary directory removed at the end")
    chaos.add_argument("--defaults", action="store_true",
                       help="the shipped defaults' bar: the fleet's config names only "
                            "addresses, ports, R3 streams and the simulator (every timeout "
                            "and the failover mode as shipped), plain SSE clients, and "
                            "dispatchers, workers and NATS nodes killed; exit 1 if any "
                            "stream that began did not complete")
    chaos.add_argument("--no-resume", action="store_true",
                       help="plain streams: a lost connection ends the request (default: "
                            "resumable streams, resumed on any edge after a lost connection)")

    status = sub.add_parser(
        "status", help="live view of models, workers, queues and rates",
        description="Models (workers, slots, queue depth, oldest waiting job, queue mode, "
                    "rates) and live workers, read from NATS and Redis. Ctrl-C quits.")
    add_common(status)
    status.add_argument("--json", action="store_true",
                        help="print one JSON document (rates over --interval) and exit")
    status.add_argument("--once", action="store_true",
                        help="print the view once (rates over --interval) and exit")
    status.add_argument("--interval", type=float, metavar="SECONDS",
                        help="refresh interval, and the window of the rates (default: 2; "
                             "1 with --json or --once)")
    status.add_argument("--data-dir", metavar="DIR",
                        help="a tidegate up's data dir: show its processes and restarts "
                             "(default: the --config file's directory)")

    console = sub.add_parser(
        "console", help="the operator console: live view, usage and admin in a browser",
        description="Serve the operator console at http://HOST:PORT/console: live models, "
                    "workers and batches, usage by tenant, key and model, and key, policy, "
                    "tenant and batch admin. Sign in with an admin key (`tidegate keys "
                    "create --admin`). Runs with the admin NATS credentials; see "
                    "docs/console.md.")
    add_common(console)
    console.add_argument("--host", default="127.0.0.1",
                         help="address to listen on (default: 127.0.0.1)")
    console.add_argument("--port", type=int, default=8090, help="port (default: 8090)")
    console.add_argument("--interval", type=float, default=2.0, metavar="SECONDS",
                         help="how often the live numbers are read (default: 2)")
    console.add_argument("--data-dir", metavar="DIR",
                         help="a tidegate up's data dir: show its processes (default: the "
                              "--config file's directory)")

    admin_parsers(sub)
    spend_parsers(sub)
    natscfg = sub.add_parser(
        "nats-config", help="write nats-server users and per-tier credentials",
        description="Write DIR/auth.conf (an authorization block: one user per tier with "
                    "least-privilege permissions) and DIR/<tier>.creds.toml; see "
                    "docs/security.md.")
    add_common(natscfg)
    natscfg.add_argument("--out", metavar="DIR", default=".tidegate/nats-auth",
                         help="where to write (default: .tidegate/nats-auth)")
    natscfg.add_argument("--rotate", action="store_true",
                         help="new passwords even where credentials exist")
    natscfg.add_argument("--edges", metavar="ID[,ID...]", default="",
                         help="one login per edge, by edge.edge_id (edge.<id>.creds.toml): "
                              "each reads only its own replies; without it the edges share one")
    setup = sub.add_parser(
        "setup", help="create or update every stream, consumer and bucket (admin)",
        description="Create or update every JetStream stream, consumer, KV bucket and object "
                    "store the tiers use, with the admin credentials (nats.credentials with "
                    "{tier} = admin). With per-tier credentials the tiers may not create "
                    "them: run this before starting them and after changing models or "
                    "limits (tidegate up runs it itself). Idempotent; see docs/security.md.")
    add_common(setup)
    sub.add_parser("version", help="print the version")
    return parser


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def _cmd_version(_args: argparse.Namespace) -> int:
    print(f"{PROG} {version()}")
    return 0


_COMMANDS = {
    "up": cmd_up,
    "edge": cmd_edge,
    "dispatcher": cmd_dispatcher,
    "worker": cmd_worker,
    "config": cmd_config,
    "version": _cmd_version,
    "bench": cmd_bench,
    "chaos": cmd_chaos,
    "keys": cmd_keys,
    "policy": cmd_policy,
    "batches": cmd_batches,
    "tenant": cmd_tenant,
    "price": cmd_price,
    "budget": cmd_budget,
    "usage": cmd_usage,
    "status": cmd_status,
    "console": cmd_console,
    "nats-config": cmd_nats_config,
    "setup": cmd_setup,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tidegate`` console script; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except TidegateError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
