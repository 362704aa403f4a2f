"""``tidegate bench``, ``chaos``, ``status`` and ``console``: measuring the
gateway, breaking it on purpose, and watching it run."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from fleet.cli.common import load_config
from tidegate.errors import ConfigError, TidegateError


def _load_bench(name: str) -> ModuleType:
    """The checkout's ``bench.<name>``, loaded by name at run time.

    ``tidegate bench`` and ``tidegate chaos`` live in the checkout's
    ``bench/``, which the wheel does not ship (its fake backends and peer
    proxies are test tools, not the gateway), so no module of ``fleet``
    imports it: the bench stands above the tools it drives (``fleet.run``
    starts its pipelines) and is a plug-in of the command, found where an
    editable install's checkout is. Its processes get the checkout on
    ``PYTHONPATH`` too (they run ``python -m bench.fake_server`` and such)."""
    root = Path(__file__).resolve().parents[2]
    if importlib.util.find_spec("bench") is None:
        if not (root / "bench" / "runner.py").is_file():
            raise TidegateError(
                "tidegate bench and tidegate chaos run from a source checkout of tidegate "
                "(git clone, then pip install -e '.[dev]'): the bench and its fake backends "
                "are not part of the installed package.")
        sys.path.insert(0, str(root))
    module = importlib.import_module(f"bench.{name}")
    root = Path(module.__file__ or root).resolve().parents[1]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(root), os.environ.get("PYTHONPATH")]))
    return module


def cmd_bench(args: argparse.Namespace) -> int:
    runner = _load_bench("runner")

    options = runner.BenchOptions(out=Path(args.out), quick=args.quick,
                                  scenarios=runner.parse_scenarios(args.scenarios),
                                  py_spy=args.py_spy, idle_streams=args.idle_streams,
                                  tidegate_config=runner.BenchOptions.parse_set(args.set))
    runner.run(options)
    print(f"results in {options.out}/ (results.md, results.json)")
    return 0


def cmd_chaos(args: argparse.Namespace) -> int:
    chaos = _load_bench("chaos")

    if args.duration <= 0 or args.concurrency < 1 or args.backends < 0:
        raise ConfigError("--duration must be > 0, --concurrency >= 1 and --backends >= 0")
    return int(chaos.run(args.duration, args.concurrency, args.seed,
                         Path(args.out) if args.out else None,
                         workdir=Path(args.workdir) if args.workdir else None,
                         resume=not args.no_resume, backends=args.backends,
                         defaults=args.defaults))


def _data_dir(args: argparse.Namespace) -> Path | None:
    # tidegate up's banner says `--config <data-dir>/tidegate.toml`: its
    # process state file sits next to that config file.
    config_path = args.config or os.environ.get("TIDEGATE_CONFIG")
    return Path(args.data_dir) if args.data_dir else (
        Path(config_path).parent if config_path else None)


def cmd_console(args: argparse.Namespace) -> int:
    from fleet.run import console
    from tidegate.telemetry import logs

    if args.interval <= 0:
        raise ConfigError(f"--interval: must be > 0, got {args.interval}")
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port: must be 1-65535, got {args.port}")
    config = load_config(args)
    logs.setup(config.logging)
    return console.run(config, args.host, args.port, _data_dir(args), args.interval)


def cmd_status(args: argparse.Namespace) -> int:
    from fleet.run import status

    if args.interval is not None and args.interval <= 0:
        raise ConfigError(f"--interval: must be > 0, got {args.interval}")
    # tidegate up's banner says `tidegate status --config <data-dir>/tidegate.toml`:
    # its process state file sits next to that config file.
    config_path = args.config or os.environ.get("TIDEGATE_CONFIG")
    data_dir = Path(args.data_dir) if args.data_dir else (
        Path(config_path).parent if config_path else None)
    return status.run(load_config(args), as_json=args.json, once=args.once,
                      interval=args.interval, data_dir=data_dir)
