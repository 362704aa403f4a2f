"""The wheel holds the gateway and nothing else: every module of tidegate/,
edge/, dispatcher/ and workers/ (a package missing from the build config
would import fine from an editable checkout and fail from a real install),
the console's page files, and no bench/ or tests/ module (the fake backends
and peer proxies are tools of the checkout, docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_wheel_holds_the_gateway_and_no_bench_or_tests(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = tmp_path.glob("tidegate-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for top in ("tidegate", "edge", "dispatcher",
                                                         "workers", "fleet")
               for p in (ROOT / top).rglob("*.py")}
    assert sorted(modules - names) == []
    assert not [n for n in names if n.startswith(("bench/", "tests/"))]
    assert any(n.startswith("fleet/run/console_assets/") for n in names)
