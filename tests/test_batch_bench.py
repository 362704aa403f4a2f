"""``tidegate bench --quick --scenarios j``: the batch scenario runs end to end
and reports both of issue 13's measures (tiny sizes: a smoke run, not numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.pipeline
def test_quick_batch_scenario(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDEGATE_", "OTEL_"))}
    done = subprocess.run([sys.executable, "-m", "fleet", "bench", "--quick", "--scenarios",
                           "j", "--out", str(out)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    j = json.loads((out / "results.json").read_text())["scenarios"]["j"]
    assert j["throughput"]["batch_status"] == "completed"
    assert j["throughput"]["interactive_lines_per_s"] > 0
    assert j["throughput"]["batch_lines_per_s"] > 0
    assert j["priority"]["ttft_p99_ms_alone"] > 0
    assert j["priority"]["ttft_p99_ms_with_batch"] > 0
    assert "## (j) batch" in (out / "results.md").read_text()
