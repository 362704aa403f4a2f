"""The ``tidegate`` command.

Subcommands::

    tidegate up          everything on one machine (embedded NATS + Redis)
    tidegate edge        the HTTP/SSE front door
    tidegate dispatcher  admission, quotas, fairness
    tidegate worker      backend calls (``--model`` to serve a subset)
    tidegate config      print the effective config as TOML
    tidegate bench       the benchmark suite (docs/benchmarks.md)
    tidegate chaos       streaming load against a local fleet while SIGKILLing it
    tidegate keys        create, list and revoke API keys (NATS KV)
    tidegate policy      set, list and delete quota policies (NATS KV)
    tidegate batches     list, show and cancel batches of every tenant (NATS KV)
    tidegate tenant      set, list and delete per-tenant settings (resumable streams)
    tidegate status      live view of models, workers, queues, batches (``--json`` once)
    tidegate version

Flags become ``overrides`` for :func:`tidegate.config.load`, so they win over
the file and the environment. Tier modules are imported inside their
subcommand: ``tidegate config`` must work even where a tier cannot import.

Error contract: a :class:`~tidegate.errors.ConfigError` prints
``tidegate: error: <message naming the key>`` and exits 2; any other
:class:`~tidegate.errors.TidegateError` prints its message and exits 1. Neither
ever shows a traceback: they are the user's to fix, not bugs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tidegate import config as tgconfig
from tidegate.config import Config
from tidegate.errors import ConfigError, TidegateError
from tidegate.telemetry import logs

if TYPE_CHECKING:
    from tidegate.run.runtime import Serve

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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="PATH",
                   help="TOML config file (default: $TIDEGATE_CONFIG, else built-in defaults)")
    p.add_argument("--nats-url", metavar="URL", help="NATS server URL(s), comma-separated")
    p.add_argument("--redis-url", metavar="URL", help="Redis URL for quotas")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="tidegate: an LLM streaming gateway over NATS JetStream.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    up = sub.add_parser("up", help="run everything on this machine",
                        description="Start an embedded NATS and Redis (unless URLs are given), "
                                    "a dispatcher, workers and an edge; stop them on Ctrl-C.")
    _common(up)
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
    up.add_argument("--ready-timeout", type=float, default=60.0, metavar="SECONDS",
                    help="how long every child may take to become ready (default: 60)")

    edge = sub.add_parser("edge", help="run the edge tier (HTTP, SSE)")
    _common(edge)
    edge.add_argument("--host", help="listen address")
    edge.add_argument("--port", type=int, help="listen port")

    dispatcher = sub.add_parser("dispatcher", help="run the dispatcher tier")
    _common(dispatcher)

    worker = sub.add_parser("worker", help="run the worker tier")
    _common(worker)
    worker.add_argument("--model", action="append", default=[], metavar="NAME",
                        help="serve only this configured model (repeatable; default: all)")

    cfg = sub.add_parser("config", help="print the effective config as TOML",
                         description="Validate the config (file + environment + flags) and "
                                     "print it as TOML; exit 2 if it is invalid.")
    _common(cfg)

    bench = sub.add_parser("bench", help="run the benchmark suite on this machine",
                           description="Measure tidegate against the fake backend directly "
                                       "and against a plain proxy; see docs/benchmarks.md.")
    bench.add_argument("--quick", action="store_true",
                       help="a smoke run of every scenario in under a minute")
    bench.add_argument("--scenarios", default="a,b,c,d,e", metavar="LIST",
                       help="comma-separated list of a (overhead), b (idle streams), "
                            "c (cancel), d (slow clients), e (other gateways), "
                            "q (quota check cost), t (telemetry overhead: off, metrics, "
                            "traced), r (Responses API overhead), w (WebSocket against "
                            "SSE), j (batch API), f (affinity across 4 replicas, on and "
                            "off), s (resumable streams: CPU per chunk, explicit cancel) "
                            "(default: a,b,c,d,e; f, j, q, r, s, t and w only when named)")
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
                    "it). Prints every request's class (complete, clean error, connection "
                    "lost, silent truncation, hang); exit 1 on any truncation or hang.")
    chaos.add_argument("--duration", type=float, default=60.0, metavar="SECONDS",
                       help="how long the load and the kills run (default: 60)")
    chaos.add_argument("--concurrency", type=int, default=8, metavar="N",
                       help="streaming clients (default: 8)")
    chaos.add_argument("--seed", type=int, default=1, help="seed of the kill schedule")
    chaos.add_argument("--out", metavar="FILE", help="also write the JSON report here")
    chaos.add_argument("--no-resume", action="store_true",
                       help="plain streams: a lost connection ends the request (default: "
                            "resumable streams, resumed on any edge after a lost connection)")

    status = sub.add_parser(
        "status", help="live view of models, workers, queues and rates",
        description="Models (workers, slots, queue depth, oldest waiting job, queue mode, "
                    "rates) and live workers, read from NATS and Redis. Ctrl-C quits.")
    _common(status)
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

    _admin_parsers(sub)
    natscfg = sub.add_parser(
        "nats-config", help="write nats-server users and per-tier credentials",
        description="Write DIR/auth.conf (an authorization block: one user per tier with "
                    "least-privilege permissions) and DIR/<tier>.creds.toml; see "
                    "docs/security.md.")
    _common(natscfg)
    natscfg.add_argument("--out", metavar="DIR", default=".tidegate/nats-auth",
                         help="where to write (default: .tidegate/nats-auth)")
    natscfg.add_argument("--rotate", action="store_true",
                         help="new passwords even where credentials exist")
    sub.add_parser("version", help="print the version")
    return parser


def _name(value: str) -> str:
    if not value.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _limit(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 = unlimited), got {number}")
    return number


def _models(value: str) -> tuple[str, ...]:
    from tidegate.control.admin import UsageError, parse_models

    try:
        return parse_models(value)
    except UsageError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated model names, got {value!r}") from None


def _key_id(value: str) -> str:
    value = value.strip().lower()
    if len(value) < 12 or any(c not in "0123456789abcdef" for c in value):
        raise argparse.ArgumentTypeError(
            f"a key id is the 12 hex characters `tidegate keys list` shows, got {value!r}")
    return value


def _duration(value: str) -> float:
    from tidegate.control.admin import UsageError, parse_duration

    try:
        return parse_duration(value)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _admin_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create, list and revoke API keys",
                          description="API keys live hashed in the NATS KV bucket TG_KEYS; "
                                      "edges pick up changes within a second. See "
                                      "docs/keys-and-policies.md.")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (once)")
    _common(create)
    create.add_argument("--tenant", required=True, type=_name, help="tenant the key bills to")
    create.add_argument("--user", type=_name, help="user within the tenant (optional)")
    create.add_argument("--models", type=_models, default=(), metavar="A,B",
                        help="models the key may use (default: all)")
    create.add_argument("--json", action="store_true", help="print the key and record as JSON")
    create.add_argument("--expires", type=_duration, default=0.0, metavar="DURATION",
                        help="the key stops working after this long, e.g. 30d, 12h "
                             "(default: never)")
    rotate = keys_sub.add_parser(
        "rotate", help="replace a key: a new one now, the old one expires after --overlap")
    _common(rotate)
    rotate.add_argument("key_id", metavar="KEY_ID", type=_key_id,
                        help="the key id shown by `keys create` / `keys list`")
    rotate.add_argument("--overlap", type=_duration, default=3600.0, metavar="DURATION",
                        help="how long the old key keeps working (default: 1h)")
    rotate.add_argument("--expires", type=_duration, default=0.0, metavar="DURATION",
                        help="the new key's lifetime (default: never)")
    rotate.add_argument("--json", action="store_true", help="print JSON")
    listing = keys_sub.add_parser("list", help="list keys (never the keys themselves)")
    _common(listing)
    listing.add_argument("--json", action="store_true", help="print JSON")
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its key id")
    _common(revoke)
    revoke.add_argument("key_id", metavar="KEY_ID", type=_key_id,
                        help="the key id shown by `keys create` / `keys list`")

    policy = sub.add_parser("policy", help="set, list and delete quota policies",
                            description="Quota policies live in the NATS KV bucket "
                                        "TG_POLICIES; dispatchers pick up changes within a "
                                        "second. See docs/keys-and-policies.md.")
    policy_sub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    pset = policy_sub.add_parser(
        "set", help="set the limits of one scope (replacing its previous policy)",
        description="Scope: --tenant, --model, --tenant with --model, --tenant with --user. "
                    "Limits left out are unlimited; give at least one.")
    pdelete = policy_sub.add_parser("delete", help="delete the policy of one scope")
    for p in (pset, pdelete):
        _common(p)
        # No string defaults: argparse would run them through the type check.
        p.add_argument("--tenant", type=_name, help="tenant (default: any)")
        p.add_argument("--model", type=_name, help="model (default: any)")
        p.add_argument("--user", type=_name, help="user of --tenant (default: any)")
    pset.add_argument("--rpm", type=_limit, metavar="N", help="requests per minute")
    pset.add_argument("--tpm", type=_limit, metavar="N", help="tokens per minute")
    pset.add_argument("--concurrency", type=_limit, metavar="N", help="concurrent streams")
    plist = policy_sub.add_parser("list", help="list policies")
    _common(plist)
    plist.add_argument("--json", action="store_true", help="print JSON")
    _tenant_parsers(sub)


def _on_off(value: str) -> bool:
    v = value.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {value!r}")


def _seconds(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value!r}")
    return number


def _tenant_parsers(sub: Any) -> None:
    tenant = sub.add_parser("tenant", help="set, list and delete per-tenant settings",
                            description="Tenant settings (resumable streams) live in the NATS "
                                        "KV bucket TG_TENANTS; edges pick up changes within a "
                                        "second. See docs/resume.md.")
    tenant_sub = tenant.add_subparsers(dest="tenant_command", metavar="ACTION", required=True)
    tset = tenant_sub.add_parser("set", help="set a tenant's settings (replacing them)")
    _common(tset)
    tset.add_argument("tenant", metavar="TENANT", type=_name)
    tset.add_argument("--resumable", type=_on_off, required=True, metavar="on|off",
                      help="every streaming request of the tenant is resumable")
    tset.add_argument("--grace", type=_seconds, metavar="SECONDS",
                      help="the tenant's resume grace (default: resume.grace)")
    tdelete = tenant_sub.add_parser("delete", help="delete a tenant's settings")
    _common(tdelete)
    tdelete.add_argument("tenant", metavar="TENANT", type=_name)
    tlist = tenant_sub.add_parser("list", help="list tenant settings")
    _common(tlist)
    tlist.add_argument("--json", action="store_true", help="print JSON")

    batches = sub.add_parser("batches", help="list, show and cancel batches",
                             description="Batches of every tenant, from the NATS KV bucket "
                                         "TG_BATCHES. See docs/batch.md.")
    batches_sub = batches.add_subparsers(dest="batches_command", metavar="ACTION",
                                         required=True)
    blist = batches_sub.add_parser("list", help="list batches, newest first")
    _common(blist)
    blist.add_argument("--tenant", type=_name, help="only this tenant's")
    blist.add_argument("--status", help="only batches in this status (e.g. in_progress)")
    blist.add_argument("--json", action="store_true", help="print JSON")
    for action, text in (("show", "print one batch as JSON"),
                         ("cancel", "cancel a batch (as its tenant's API call would)")):
        p = batches_sub.add_parser(action, help=text)
        _common(p)
        p.add_argument("batch_id", metavar="BATCH_ID", help="batch_...")


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


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


def _cmd_config(args: argparse.Namespace) -> int:
    config = redacted(load_config(args))  # an invalid config prints nothing
    sys.stdout.write("# secrets (API keys, URL passwords) redacted\n")
    sys.stdout.write(tgconfig.dump_toml(config))
    sys.stdout.flush()
    return 0


def _cmd_nats_config(args: argparse.Namespace) -> int:
    from pathlib import Path

    from tidegate.broker import natsconfig

    config = load_config(args)
    out = Path(args.out)
    auth = natsconfig.write(out, config.nats.subjects, rotate=args.rotate)
    print(f"wrote {auth} and {out}/<tier>.creds.toml (edge, dispatcher, worker, admin)")
    print(f"  nats-server: -c {auth} (or include it in your server config)")
    print(f'  tidegate:    [nats] credentials = "{natsconfig.credentials_setting(out)}"')
    return 0


def _cmd_version(_args: argparse.Namespace) -> int:
    print(f"{PROG} {version()}")
    return 0


def _run_tier(tier: str, serve: Serve, config: Config) -> int:
    """A tier process's last step: freeze the startup heap (imports, config)
    out of the cyclic GC, then serve until stopped."""
    from tidegate.run.runtime import freeze_startup_heap, run_service
    from tidegate.telemetry.observability import instrumented

    freeze_startup_heap()
    return run_service(instrumented(serve, tier), config)


def _cmd_edge(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from edge.service import serve

    return _run_tier("edge", serve, config)


def _cmd_dispatcher(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from dispatcher.service import serve

    return _run_tier("dispatcher", serve, config)


def _cmd_worker(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from workers.service import serve

    return _run_tier("worker", serve, config)


def _cmd_up(args: argparse.Namespace) -> int:
    from tidegate.run import launcher

    options = launcher.UpOptions(
        config_path=args.config,
        data_dir=Path(args.data_dir),
        host=args.host,
        port=args.port,
        nats_url=args.nats_url,
        redis_url=args.redis_url,
        workers=args.workers,
        edges=args.edges,
        dispatchers=args.dispatchers,
        restart=_restart_policy(args),
        backends=tuple(args.backend),
        backend_key_env=args.backend_key_env,
        models=tuple(args.model),
        ready_timeout=args.ready_timeout,
        nats_auth=not args.no_nats_auth,
    )
    plan = launcher.prepare(options)
    logs.setup(plan.config.logging)
    return launcher.Launcher(plan).run()


def _restart_policy(args: argparse.Namespace) -> Any:
    from tidegate.run.supervisor import RestartPolicy

    if args.crash_limit < 1:
        raise ConfigError(f"--crash-limit: must be >= 1, got {args.crash_limit}")
    if args.crash_window <= 0:
        raise ConfigError(f"--crash-window: must be > 0, got {args.crash_window}")
    return RestartPolicy(crash_limit=args.crash_limit, crash_window=args.crash_window)


def _cmd_bench(args: argparse.Namespace) -> int:
    from tidegate.bench import runner

    options = runner.BenchOptions(out=Path(args.out), quick=args.quick,
                                  scenarios=runner.parse_scenarios(args.scenarios),
                                  py_spy=args.py_spy, idle_streams=args.idle_streams,
                                  tidegate_config=runner.BenchOptions.parse_set(args.set))
    runner.run(options)
    print(f"results in {options.out}/ (results.md, results.json)")
    return 0


def _cmd_chaos(args: argparse.Namespace) -> int:
    from tidegate.bench import chaos

    if args.duration <= 0 or args.concurrency < 1:
        raise ConfigError("--duration must be > 0 and --concurrency >= 1")
    return chaos.run(args.duration, args.concurrency, args.seed,
                     Path(args.out) if args.out else None, resume=not args.no_resume)


def _cmd_keys(args: argparse.Namespace) -> int:
    from tidegate.control import admin

    config = load_config(args)
    if args.keys_command == "create":
        return admin.keys_create(config, args.tenant, args.user or "", args.models, args.json,
                                 expires_in=args.expires)
    if args.keys_command == "list":
        return admin.keys_list(config, args.json)
    if args.keys_command == "rotate":
        return admin.keys_rotate(config, args.key_id, args.overlap, args.expires, args.json)
    return admin.keys_revoke(config, args.key_id)


def _cmd_policy(args: argparse.Namespace) -> int:
    from tidegate.control import admin

    config = load_config(args)
    if args.policy_command == "set":
        return admin.policy_set(config, args.tenant or "", args.model or "", args.user or "",
                                args.rpm, args.tpm, args.concurrency)
    if args.policy_command == "list":
        return admin.policy_list(config, args.json)
    return admin.policy_delete(config, args.tenant or "", args.model or "", args.user or "")


def _cmd_batches(args: argparse.Namespace) -> int:
    from tidegate.control import batch_admin

    config = load_config(args)
    if args.batches_command == "list":
        return batch_admin.batches_list(config, args.json, args.tenant or "",
                                        args.status or "")
    if args.batches_command == "show":
        return batch_admin.batches_show(config, args.batch_id)
    return batch_admin.batches_cancel(config, args.batch_id)


def _cmd_tenant(args: argparse.Namespace) -> int:
    from tidegate.control import tenants

    config = load_config(args)
    if args.tenant_command == "set":
        return tenants.cli_set(config, args.tenant, args.resumable, args.grace)
    if args.tenant_command == "list":
        return tenants.cli_list(config, args.json)
    return tenants.cli_delete(config, args.tenant)


def _cmd_status(args: argparse.Namespace) -> int:
    from tidegate.run import status

    if args.interval is not None and args.interval <= 0:
        raise ConfigError(f"--interval: must be > 0, got {args.interval}")
    # tidegate up's banner says `tidegate status --config <data-dir>/tidegate.toml`:
    # its process state file sits next to that config file.
    config_path = args.config or os.environ.get("TIDEGATE_CONFIG")
    data_dir = Path(args.data_dir) if args.data_dir else (
        Path(config_path).parent if config_path else None)
    return status.run(load_config(args), as_json=args.json, once=args.once,
                      interval=args.interval, data_dir=data_dir)


_COMMANDS = {
    "up": _cmd_up,
    "edge": _cmd_edge,
    "dispatcher": _cmd_dispatcher,
    "worker": _cmd_worker,
    "config": _cmd_config,
    "version": _cmd_version,
    "bench": _cmd_bench,
    "chaos": _cmd_chaos,
    "keys": _cmd_keys,
    "policy": _cmd_policy,
    "batches": _cmd_batches,
    "tenant": _cmd_tenant,
    "status": _cmd_status,
    "nats-config": _cmd_nats_config,
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
