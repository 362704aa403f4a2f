"""The suite's grouping holds (tests/conftest.py): under ``-n 2 --dist
loadgroup`` every test of one ``xdist_group`` runs on one worker. The
`tidegate up` tests share a group because they take fixed ports (8080,
8090) when free; when pytest 9.2 and pytest-xdist 3.8 stopped honouring the
groups, two of them ran at once and one stack's console answered the other's
test (CI). This runs the installed pair on two small groups and fails if
either group is split."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

TEST = '''import pytest
pytestmark = pytest.mark.xdist_group("{group}")

@pytest.mark.parametrize("i", range(8))
def test_one(i):
    pass
'''


def test_each_group_runs_on_one_worker(tmp_path: Path) -> None:
    for group in ("first", "second"):
        (tmp_path / f"test_{group}.py").write_text(TEST.format(group=group))
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's options
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2",
         "--dist", "loadgroup", "-v", str(tmp_path)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    workers: dict[str, set[str]] = {}
    for worker, name in re.findall(r"\[(gw\d)\].*PASSED \S*test_(first|second)\.py", done.stdout):
        workers.setdefault(name, set()).add(worker)
    assert set(workers) == {"first", "second"}, done.stdout
    assert all(len(w) == 1 for w in workers.values()), workers
