"""Shared fixtures: fresh nats-server / redis-server processes on free ports.

``nats_server`` and ``redis_server`` are function-scoped: each test gets its
own servers in its own tmp dir, stopped (and their ports freed) afterwards, so
a fault test may kill or restart them freely. ``module_nats_url`` /
``module_redis_url`` share one server per test module for the slower pipeline
tests. See ``tests/servers.py`` for local binaries versus testcontainers.

Nothing here ever touches ports 4222/6379: servers always get free ports.

Every test that starts nats-server, redis-server or a tidegate tier is a
``pipeline`` test, so ``-m "not pipeline"`` is a real quick run: a test using
one of the server fixtures gets the mark at collection, and a test without it
that starts such a process anyway fails (``_guarded_init``), unless it is
marked ``exits_at_once`` (a tier command that must refuse bad input at once).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from fleet.run.clusters import NatsCluster, RedisCluster
from tests.servers import (
    ServerHandle,
    start_nats,
    start_nats_cluster,
    start_redis,
    start_redis_cluster,
)

# The checkout's bench/ (fake backends, peer proxies, tidegate bench) is not
# installed: every process a test starts finds it here, whatever its cwd.
_ROOT = str(Path(__file__).resolve().parent.parent)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))
# The gRPC tests hold grpcio channels in this process, which starts tiers
# with fork + exec: grpcio's fork handlers then skip ("other threads are
# calling into gRPC") and a child once hung before its exec, so its tier
# never started. Nothing here needs gRPC in a forked child.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[ServerHandle]:
    """nats-server with JetStream, state in this test's tmp dir."""
    server = start_nats(tmp_path / "nats")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[ServerHandle]:
    """redis-server without persistence."""
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    server = start_nats(tmp_path_factory.mktemp("nats"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def module_nats_url(module_nats_server: ServerHandle) -> str:
    return module_nats_server.url


@pytest.fixture(scope="module")
def module_redis_url(module_redis_server: ServerHandle) -> str:
    return module_redis_server.url


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A 3-node JetStream cluster on free ports; ``.url`` lists all three."""
    cluster = start_nats_cluster(tmp_path / "nats-cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A 3-primary Redis Cluster on free ports; ``.url`` is ``redis+cluster://...``."""
    cluster = start_redis_cluster(tmp_path / "redis-cluster")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every TIDEGATE_* config variable, so the developer's shell cannot leak in."""
    for name in list(os.environ):
        if name.startswith("TIDEGATE_") and not name.startswith("TIDEGATE_TEST_"):
            monkeypatch.delenv(name)


# ---------------------------------------------------------------------------
# The pipeline mark, enforced
# ---------------------------------------------------------------------------

SERVER_FIXTURES = frozenset({"nats_server", "redis_server", "module_nats_server",
                             "module_redis_server", "module_nats_url", "module_redis_url"})
# `python -m fleet <these>` starts servers or tiers; `keys`, `config`,
# `policy` and friends are quick admin commands.
SERVER_COMMANDS = frozenset({"up", "edge", "dispatcher", "worker", "bench"})


# The suite runs on two pytest-xdist workers (`-n 2 --dist loadgroup` in
# pyproject.toml): most of its time is spent waiting on processes it started,
# not on the CPU. Each test file is one group, so a module-scoped pipeline
# starts once, on one worker. The files that run `tidegate up` share a group:
# up takes ports 4222, 6379 and 8080 when they are free, and two stacks
# probing them at once could both pick the same one (edges even share theirs,
# with SO_REUSEPORT).
UP_FILES = frozenset({"test_cli.py", "test_launcher.py", "test_readme.py", "test_soak.py",
                      "test_supervisor.py"})


# tryfirst: xdist reads the group marks in its own hook of this name.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if SERVER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.pipeline)
        group = "tidegate-up" if item.path.name in UP_FILES else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))


def _tidegate_command(names: Sequence[str]) -> str | None:
    """The subcommand of ``tidegate X`` / ``python -m fleet X``, else None."""
    for i, arg in enumerate(names[:-1]):
        if (arg == "tidegate" and i == 0) or (arg == "fleet" and i and names[i - 1] == "-m"):
            return names[i + 1]
    return None


def starts_servers(argv: Sequence[str]) -> bool:
    """Whether a command line starts nats-server, redis-server or a tidegate tier."""
    names = [os.path.basename(a) for a in argv]
    if names and names[0] in ("nats-server", "redis-server"):
        return not {"--version", "-v"} & set(names)  # a version query serves nothing
    return _tidegate_command(names) in SERVER_COMMANDS


_running: list[tuple[str, bool]] = []  # the running test: (node id, marked pipeline)
_popen_init = subprocess.Popen.__init__


def _guarded_init(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    if _running:
        nodeid, marked = _running[0]
        argv = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
        names = [os.path.basename(os.fsdecode(a)) for a in argv]
        if not marked and starts_servers(names):
            raise RuntimeError(f"{nodeid} starts {argv[:4]} but is not marked "
                               "@pytest.mark.pipeline")
        if (_tidegate_command(names) == "up"
                and os.path.basename(nodeid.split("::", 1)[0]) not in UP_FILES):
            raise RuntimeError(f"{nodeid} runs tidegate up: add its file to UP_FILES in "
                               "tests/conftest.py, so no other up runs beside it")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    marked = (item.get_closest_marker("pipeline") is not None
              or item.get_closest_marker("exits_at_once") is not None)
    _running.append((item.nodeid, marked))
    try:
        return (yield)
    finally:
        _running.clear()
