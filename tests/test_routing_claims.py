"""workers/routing.py's claim of a job that exists twice, when the claims
bucket does not answer for a while (its JetStream leader being elected
after a NATS node's death): the worker asks again in-process, the job kept
in progress, instead of handing it back (a nak costs a delivery each, and a
long outage would spend all of ``worker.max_deliver``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors

from tidegate.wire.affinity import CLAIM_HEADER
from workers import routing
from workers.routing import Claim, WorkerRouting


class Claims:
    """A claims bucket that times out ``down`` times, then answers."""

    def __init__(self, down: int) -> None:
        self.down, self.calls = down, 0
        self.values: dict[str, bytes] = {}

    async def create(self, key: str, value: bytes) -> None:
        self.calls += 1
        if self.calls <= self.down:
            raise nats.errors.TimeoutError
        if key in self.values:
            raise nats.js.errors.KeyWrongLastSequenceError
        self.values[key] = value

    async def get(self, key: str) -> Any:
        return SimpleNamespace(value=self.values[key])


class Msg:
    def __init__(self, copy: str) -> None:
        self.headers = {CLAIM_HEADER: copy}
        self.fate: list[str] = []

    async def in_progress(self) -> None:
        self.fate.append("in_progress")

    async def nak(self, delay: float | None = None) -> None:
        self.fate.append("nak")


async def test_a_claim_waits_out_a_bucket_that_does_not_answer(monkeypatch: Any) -> None:
    monkeypatch.setattr(routing, "CLAIM_RETRY", 0.01)
    claims = Claims(down=3)
    r = WorkerRouting(None, None, claims, "homes")  # type: ignore[arg-type]
    msg = Msg("routed")
    assert await r.claim_within(msg, "r1", 30.0) == Claim.RUN  # type: ignore[arg-type]
    assert claims.calls == 4
    assert msg.fate == ["in_progress"] * 3, "kept, never handed back"
    # The other copy then loses, at once.
    assert await r.claim_within(Msg("fallback"), "r1", 30.0) == Claim.DROP  # type: ignore[arg-type]


async def test_a_bucket_down_past_the_bound_leaves_the_job_for_redelivery(
        monkeypatch: Any) -> None:
    monkeypatch.setattr(routing, "CLAIM_RETRY", 0.01)
    r = WorkerRouting(None, None, Claims(down=10**6), "homes")  # type: ignore[arg-type]
    msg = Msg("routed")
    assert await r.claim_within(msg, "r1", 0.05) == Claim.RETRY  # type: ignore[arg-type]
    assert msg.fate
    assert set(msg.fate) == {"in_progress"}
