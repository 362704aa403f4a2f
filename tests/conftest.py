"""Shared fixtures: fresh nats-server / redis-server processes on free ports.

``nats_server`` and ``redis_server`` are function-scoped: each test gets its
own servers in its own tmp dir, stopped (and their ports freed) afterwards, so
a fault test may kill or restart them freely. ``module_nats_url`` /
``module_redis_url`` share one server per test module for the slower pipeline
tests. See ``tests/servers.py`` for local binaries versus testcontainers.

Nothing here ever touches ports 4222/6379: servers always get free ports.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerHandle, start_nats, start_redis


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
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Remove every TIDEGATE_* config variable, so the developer's shell cannot leak in."""
    for name in list(os.environ):
        if name.startswith("TIDEGATE_") and not name.startswith("TIDEGATE_TEST_"):
            monkeypatch.delenv(name)
