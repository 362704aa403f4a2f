"""The README's quick start, as a new user runs it (issue 19).

The two commands are read from README.md (tests/readme.py). The run command
is run verbatim in a fresh copy of the checkout, with a fresh environment
whose ``pip`` refuses to install as a PEP 668 "externally managed" system
Python does (Debian 12, Ubuntu 23.04+): until ``/readyz`` answers and a
streamed request completes, then Ctrl-C. The test command is what ``.ci/run``
runs, verbatim, which the quick test here checks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from fleet.run.servers import free_port, http_ok, port_is_free
from tests.readme import quick_start_commands
from tests.servers import descendants, is_alive, kill_all, wait_until

ROOT = Path(__file__).resolve().parents[1]
VENV = "python3 -m venv .venv && . .venv/bin/activate && "
PEP668 = """#!/bin/sh
echo "error: externally-managed-environment" >&2
echo "(a PEP 668 system Python, emulated by tests/test_readme.py)" >&2
exit 1
"""


def test_quick_start_is_two_commands_that_work_without_a_system_pip() -> None:
    commands = quick_start_commands()
    for name, tail in (("run", "tidegate up"), ("test", "python -m pytest")):
        command = commands[name]
        assert command.startswith(VENV), f"the {name} command must make its own venv first"
        assert command.endswith(tail), command
        assert "pip install -e '.[dev]'" in command


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'readme_test="$(python3 tests/readme.py test)"' in ci
    assert 'bash -c "$readme_test"' in ci
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "readme.py"), "test"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == quick_start_commands()["test"]
    # Lint and types still run, after it, in the venv it made.
    after = ci.split('bash -c "$readme_test"', 1)[1]
    assert ". .venv/bin/activate" in after
    assert "ruff check ." in after
    assert "\nmypy\n" in after


def fresh_checkout(dest: Path) -> None:
    """The checkout's files (tracked and new, not ignored) in ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.split(b"\0")
    for raw in filter(None, listed):
        src = ROOT / os.fsdecode(raw)
        if src.is_file():
            (dest / src.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / src.relative_to(ROOT))


def fresh_environment(tmp: Path) -> dict[str, str]:
    """No active venv, no PYTHONPATH, no tidegate settings, and a ``pip`` that
    refuses like an externally managed system Python. pip's own settings
    (index, wheel cache) stay: they are the machine's, not the project's."""
    shims = tmp / "system-bin"
    shims.mkdir()
    for name in ("pip", "pip3"):
        (shims / name).write_text(PEP668)
        (shims / name).chmod(0o755)
    venv = os.environ.get("VIRTUAL_ENV", "")
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and not (venv and p.startswith(venv))]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TIDEGATE") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join([str(shims), *path])
    # The README's 8080 may be taken on a shared machine; up picks another
    # free port anyway, this only makes the choice independent of the machine.
    env["TIDEGATE__EDGE__PORT"] = str(free_port())
    return env


@pytest.mark.pipeline
@pytest.mark.slow
# A fresh venv and pip install of every dependency (up to 420 s on a loaded
# box) before tidegate up starts: past the suite's default 300 s timeout.
@pytest.mark.timeout(900)
def test_the_run_command_serves_a_stream_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    checkout = tmp_path / "checkout"
    fresh_checkout(checkout)
    env = fresh_environment(tmp_path)
    assert subprocess.run(["pip", "install", "x"], env=env, capture_output=True).returncode, \
        "the emulated system pip must refuse"
    out_path, err_path = tmp_path / "stdout", tmp_path / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(["bash", "-c", quick_start_commands()["run"]], cwd=checkout,
                                env=env, stdout=out, stderr=err, start_new_session=True)
    children: list[tuple[int, int]] = []

    def diagnostics() -> str:
        logs = sorted((checkout / ".tidegate" / "logs").glob("*.log"))
        return "\n".join([f"stdout:\n{out_path.read_text()[-3000:]}",
                          f"stderr:\n{err_path.read_text()[-3000:]}",
                          *(f"{p.name}:\n{p.read_text()[-1500:]}" for p in logs)])

    try:
        # pip installs into the new .venv first (from pip's cache: well under
        # a minute on an idle machine), then tidegate up prints its banner.
        assert wait_until(lambda: "URL:" in out_path.read_text() or proc.poll() is not None,
                          420, interval=0.5), diagnostics()
        assert proc.poll() is None, diagnostics()
        banner = out_path.read_text()
        url = next(line.split()[-1] for line in banner.splitlines()
                   if line.strip().startswith("URL:"))
        assert (checkout / ".venv" / "bin" / "tidegate").exists(), "installed into .venv"
        key = (checkout / ".tidegate" / "dev_key").read_text().strip()
        assert key in banner
        assert http_ok(url.removesuffix("/v1") + "/readyz"), diagnostics()
        children = descendants(proc.pid)
        req = urllib.request.Request(
            f"{url}/chat/completions", method="POST",
            data=json.dumps({"model": "tidegate-sim", "stream": True, "max_tokens": 8,
                             "messages": [{"role": "user", "content": "Say hello"}]}).encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            events = [line[6:].strip() for line in resp.read().split(b"\n")
                      if line.startswith(b"data: ")]
        assert events[-1] == b"[DONE]", events
        assert "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if json.loads(e)["choices"]).strip()

        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the group
        started = time.monotonic()
        code = proc.wait(timeout=90)
        assert code == 0, f"exit {code} after Ctrl-C\n{diagnostics()}"
        assert time.monotonic() - started < 60
        assert wait_until(lambda: not any(is_alive(c) for c in children), 15), diagnostics()
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        assert wait_until(lambda: port_is_free(port), 10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_all(children)
