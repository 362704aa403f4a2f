"""Setup a tier does at start rides out a forming cluster (broker.patiently):
transient JetStream errors are retried, others are not."""

from __future__ import annotations

from typing import Any

import nats.errors
import nats.js.errors
import pytest

from tidegate.broker import broker, objects
from tidegate.config import Config


class FlakyJetStream:
    """Answers ``key_value``/``object_store`` with ``failures`` timeouts first."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or nats.errors.TimeoutError()
        self.calls = 0

    async def key_value(self, bucket: str) -> Any:
        return self._answer(bucket)

    async def object_store(self, bucket: str) -> Any:
        return self._answer(bucket)

    def _answer(self, bucket: str) -> Any:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return f"handle:{bucket}"


async def test_a_bucket_survives_timeouts_of_an_election(
        monkeypatch: pytest.MonkeyPatch) -> None:
    js = FlakyJetStream(failures=2)
    kv = await broker.ensure_bucket(js, Config(), "B", "test")  # type: ignore[arg-type]
    assert kv == "handle:B"
    assert js.calls == 3


async def test_the_object_store_too() -> None:
    js = FlakyJetStream(failures=1)
    store = await objects.ensure_store(js, "F", ttl=60, replicas=1,  # type: ignore[arg-type]
                                       file_storage=True)
    assert store == "handle:F"
    assert js.calls == 2


async def test_a_cluster_without_a_reachable_leader_is_waited_out() -> None:
    """A node cut from its peers answers 503 with err_code 10008 ("JetStream
    system temporarily unavailable") until the heal: a dispatcher and a
    worker starting then exited on it (tests/test_partitions.py, CI)."""
    js = FlakyJetStream(failures=2, error=nats.js.errors.ServiceUnavailableError(
        code=503, err_code=broker.JS_CLUSTER_NOT_AVAILABLE,
        description="JetStream system temporarily unavailable"))
    kv = await broker.ensure_bucket(js, Config(), "B", "test")  # type: ignore[arg-type]
    assert kv == "handle:B"
    assert js.calls == 3


async def test_a_503_is_not_retried_for_a_bucket() -> None:
    """A server without JetStream answers 503: the admin CLI says so at once."""
    js = FlakyJetStream(failures=1, error=nats.js.errors.ServiceUnavailableError())
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        await broker.ensure_bucket(js, Config(), "B", "test")  # type: ignore[arg-type]
    assert js.calls == 1


async def test_patience_runs_out_and_other_errors_are_not_retried(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(broker, "_SETUP_PATIENCE", 0.0)
    with pytest.raises(nats.errors.TimeoutError):
        await broker.ensure_bucket(FlakyJetStream(failures=100), Config(), "B",  # type: ignore[arg-type]
                                   "test")
    js = FlakyJetStream(failures=1, error=ValueError("not transient"))
    with pytest.raises(ValueError, match="not transient"):
        await broker.ensure_bucket(js, Config(), "B", "test")  # type: ignore[arg-type]
    assert js.calls == 1
