"""Mutation testing of the modules that keep the promises (docs/testing.md).

``python -m tests.mutation [NAME ...]`` runs mutmut on each named module (all
of MODULES without names) with only the test files that module needs, one
mutant at a time (the box is shared). Not run by CI: it takes hours.

Each module gets its own copy of the checkout under ``.mutation/NAME/`` with a
``[tool.mutmut]`` table written into that copy's pyproject.toml, because
mutmut reads its configuration from the current directory and copies the tree
into ``mutants/`` there: the checkout itself is never written. Results stay
there: ``--show NAME`` lists the survivors with their diffs, ``--survivors``
runs them again after tests were added, ``cd .mutation/NAME && mutmut show
MUTANT`` shows one.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["tidegate", "edge", "dispatcher", "workers", "fleet", "bench"]

# module -> the test files that exercise it in this process (mutmut maps tests
# to functions by calling them; a mutant reached only from a tier process a
# pipeline test starts is seen by no test). Real-server tests are included
# where the promise is only checked against nats-server or redis-server.
MODULES: dict[str, tuple[str, list[str]]] = {
    "flow": ("tidegate/wire/flow.py", ["tests/test_flow.py", "tests/test_relay_direct.py",
                                       "tests/test_fencing_token.py"]),
    "liveness": ("tidegate/broker/liveness.py", ["tests/test_liveness_unit.py",
                                                 "tests/test_presence.py"]),
    "streamlog": ("tidegate/wire/streamlog.py", ["tests/test_streamlog.py",
                                                 "tests/test_resume_drain_race.py",
                                                 "tests/test_fencing_token.py"]),
    "permissions": ("tidegate/broker/permissions.py", ["tests/test_permissions_rules.py",
                                                       "tests/test_nats_permissions.py",
                                                       "tests/test_nats_walk.py"]),
    "quota_scripts": ("dispatcher/quota_scripts.py", ["tests/test_quota.py"]),
    "admission": ("dispatcher/admission.py", ["tests/test_admission_unit.py",
                                              "tests/test_dispatcher_unit.py",
                                              "tests/test_refunds.py", "tests/test_spend.py"]),
    "stream": ("edge/stream.py", ["tests/test_stream_state.py", "tests/test_relay_direct.py",
                                  "tests/test_relay_copies.py"]),
    "relay": ("edge/relay.py", ["tests/test_relay_direct.py", "tests/test_relay_copies.py",
                                "tests/test_relay_heads.py", "tests/test_relay_ends.py",
                                "tests/test_relay_rules.py", "tests/test_flow.py",
                                "tests/test_writers.py", "tests/test_fencing_token.py"]),
    "job_state": ("workers/job_state.py", ["tests/test_job_state.py", "tests/test_job_unit.py"]),
    "job": ("workers/job.py", ["tests/test_job_unit.py", "tests/test_job_metrics.py",
                               "tests/test_job_rules.py", "tests/test_job_rules_flow.py",
                               "tests/test_job_rules_more.py", "tests/test_fencing_token.py",
                               "tests/test_replica_continuation.py"]),
    "continuation": ("workers/continuation.py", ["tests/test_continuation.py",
                                                 "tests/test_continued_streams.py",
                                                 "tests/test_replica_continuation.py",
                                                 "tests/test_job_unit.py"]),
    "replicas": ("workers/replicas.py", ["tests/test_replicas_unit.py",
                                         "tests/test_replica_failover.py",
                                         "tests/test_replica_continuation.py"]),
    "resumable": ("workers/resumable.py", ["tests/test_job_unit.py", "tests/test_log_end.py",
                                           "tests/test_resumable_rules.py",
                                           "tests/test_resumable_copies.py"]),
}

# mutmut's exit codes per mutant (mutmut/stats.py), folded into the table's columns.
STATUS = {1: "killed", 3: "killed", 37: "killed", 0: "survived", 5: "no tests",
          33: "no tests", 36: "timeout", 24: "timeout", -24: "timeout", 152: "timeout",
          255: "timeout"}


def _pyproject(module: str, tests: list[str]) -> str:
    base = (ROOT / "pyproject.toml").read_text()
    table = {
        "source_paths": PACKAGES,
        "only_mutate": [module],
        "pytest_add_cli_args_test_selection": tests,
        # -n0: one process (mutmut forks per mutant); a hung mutant fails fast.
        "pytest_add_cli_args": ["-n0", "-p", "no:cacheprovider", "--timeout=120", "-m",
                                "not slow"],
        "use_git_change_detection": False,
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    return base + "\n".join(lines) + "\n"


def prepare(name: str, workdir: Path, fresh: bool) -> Path:
    """Copy the checkout's files for one module's run (mutants/ and its results stay
    unless fresh: a rerun retries only what has no result, or the mutants named)."""
    module, tests = MODULES[name]
    here = workdir / name
    if fresh and here.exists():
        shutil.rmtree(here)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True, text=True).stdout.split("\n")
    for rel in filter(None, files):
        src = ROOT / rel
        if not src.is_file() or rel.startswith(".mutation/"):
            continue
        dst = here / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dst)
    (here / "pyproject.toml").write_text(_pyproject(module, tests))
    # Made before mutmut starts: an interpreter caches a PYTHONPATH entry that
    # did not exist at its start as importing nothing.
    (here / "mutants").mkdir(exist_ok=True)
    return here


def run(name: str, workdir: Path, fresh: bool, mutants: list[str]) -> int:
    here = prepare(name, workdir, fresh)
    env = dict(os.environ)
    # Processes a test starts import the mutated copy, never the checkout.
    env["PYTHONPATH"] = str(here / "mutants")
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", "1", *mutants]
    print(f"{name}: mutmut's output goes to {here / 'mutmut.log'}", flush=True)
    with open(here / "mutmut.log", "w") as out:
        return subprocess.run(cmd, cwd=here, env=env, stdout=out, stderr=subprocess.STDOUT,
                              check=False).returncode


def tally(name: str, workdir: Path) -> tuple[Counter[str], list[str]]:
    module = MODULES[name][0]
    meta = workdir / name / "mutants" / (module + ".meta")
    codes: dict[str, int | None] = json.loads(meta.read_text())["exit_code_by_key"]
    counts: Counter[str] = Counter()
    survivors = []
    for key, code in sorted(codes.items()):
        status = "not checked" if code is None else STATUS.get(code, "suspicious")
        counts[status] += 1
        if status != "killed":
            survivors.append(f"{key}: {status}")
    return counts, survivors


def show(name: str, workdir: Path) -> None:
    _, survivors = tally(name, workdir)
    for line in survivors:
        print(f"## {line}")
        mutant = line.split(":")[0]
        subprocess.run([sys.executable, "-m", "mutmut", "show", mutant], cwd=workdir / name,
                       check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"modules to run: {', '.join(MODULES)}")
    ap.add_argument("--workdir", type=Path, default=ROOT / ".mutation",
                    help="where each module's copy and results live")
    ap.add_argument("--fresh", action="store_true", help="copy the checkout again first")
    ap.add_argument("--mutant", action="append", default=[],
                    help="run only these mutants again (mutmut names, * globs)")
    ap.add_argument("--survivors", action="store_true",
                    help="run only the last run's survivors again (after adding tests)")
    ap.add_argument("--summary", action="store_true", help="print the tables; run nothing")
    ap.add_argument("--show", action="store_true", help="print each survivor's diff; run nothing")
    args = ap.parse_args()
    names = args.names or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; known: {', '.join(MODULES)}")
    if args.show:
        for name in names:
            show(name, args.workdir)
        return 0
    failed = 0
    for name in names:
        if not args.summary:
            mutants = list(args.mutant)
            if args.survivors:
                mutants += [line.split(":")[0] for line in tally(name, args.workdir)[1]
                            if line.endswith(": survived")]
            failed |= run(name, args.workdir, args.fresh, mutants) != 0
        counts, survivors = tally(name, args.workdir)
        total = sum(counts.values())
        rest = [f"{n} {s}" for s, n in sorted(counts.items()) if s != "killed"]
        print(f"{MODULES[name][0]}: " + ", ".join(
            [f"{total} mutants", f"{counts['killed']} killed", *rest]))
        for line in survivors:
            print(f"    {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
