"""``tidegate up``, ``edge``, ``dispatcher`` and ``worker``: the commands that run
the gateway, all of it on one machine or one tier per process."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fleet.cli.common import load_config
from tidegate.config import Config
from tidegate.errors import ConfigError
from tidegate.telemetry import logs

if TYPE_CHECKING:
    from fleet.run.runtime import Serve


def _run_tier(tier: str, serve: Serve, config: Config) -> int:
    """A tier process's last step: check what the config names outside itself
    (files, variables: a ConfigError, one line, exit 2), freeze the startup
    heap (imports, config) out of the cyclic GC, then serve until stopped."""
    from fleet.run.instrumented import instrumented
    from fleet.run.preflight import preflight
    from fleet.run.runtime import freeze_startup_heap, run_service

    preflight(config, tier)
    freeze_startup_heap()
    return run_service(instrumented(serve, tier), config)


def cmd_edge(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from edge.service import serve

    return _run_tier("edge", serve, config)


def cmd_dispatcher(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from dispatcher.service import serve

    return _run_tier("dispatcher", serve, config)


def cmd_worker(args: argparse.Namespace) -> int:
    config = load_config(args)
    logs.setup(config.logging)
    from workers.service import serve

    return _run_tier("worker", serve, config)


def cmd_up(args: argparse.Namespace) -> int:
    from fleet.run import launcher, planning

    options = planning.UpOptions(
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
        nats_monitor_port=args.nats_monitor_port,
        console_port=args.console_port,
    )
    plan = planning.prepare(options)
    logs.setup(plan.config.logging)
    return launcher.Launcher(plan).run()


def _restart_policy(args: argparse.Namespace) -> Any:
    from fleet.run.supervisor import RestartPolicy

    if args.crash_limit < 1:
        raise ConfigError(f"--crash-limit: must be >= 1, got {args.crash_limit}")
    if args.crash_window <= 0:
        raise ConfigError(f"--crash-window: must be > 0, got {args.crash_window}")
    return RestartPolicy(crash_limit=args.crash_limit, crash_window=args.crash_window)
