"""The operator console (``tidegate console``) as a process beside a
:class:`~tests.pipeline.Pipeline`, and the CLI calls its tests make."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fleet.run.servers import ManagedProcess, free_port, http_ok
from tests.pipeline import Pipeline


def cli(pipeline: Pipeline, *args: str) -> subprocess.CompletedProcess[str]:
    """``tidegate ARGS --config <the pipeline's>``, checked."""
    done = subprocess.run([sys.executable, "-m", "fleet", *args, "--config",
                           str(pipeline.config_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done


def create_key(pipeline: Pipeline, tenant: str, *flags: str) -> dict[str, Any]:
    """A new key through ``tidegate keys create --json`` (``--admin`` in flags)."""
    out: dict[str, Any] = json.loads(
        cli(pipeline, "keys", "create", "--tenant", tenant, "--json", *flags).stdout)
    return out


def status_json(pipeline: Pipeline) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(cli(pipeline, "status", "--json").stdout)
    return doc


@contextmanager
def running_console(pipeline: Pipeline, interval: float = 1.0) -> Iterator[str]:
    """``tidegate console`` on a free port; yields its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(
        "console", [sys.executable, "-m", "fleet", "console", "--config",
                    str(pipeline.config_path), "--port", str(port), "--interval",
                    str(interval)],
        pipeline.workdir / "logs" / f"console-{port}.log",
        ready=lambda: http_ok(f"{url}/console"), start_timeout=30.0)
    proc.start()
    try:
        yield url
    finally:
        proc.stop()


def console_log(pipeline: Pipeline) -> str:
    return "\n".join(p.read_text() for p in (pipeline.workdir / "logs").glob("console-*.log"))
