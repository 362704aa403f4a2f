"""``tidegate bench``, ``chaos`` and ``status``: measuring the gateway, breaking
it on purpose, and watching it run."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tidegate.cli.common import load_config
from tidegate.errors import ConfigError


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
