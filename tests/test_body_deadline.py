"""The body deadline's rule and scope (edge/body.py), without sockets; the
live 408s are in tests/test_upload_limits.py and tests/test_fuzz_edge.py."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from edge.body import BodyDeadline, deadline
from tidegate.config import EdgeConfig
from tidegate.errors import ApiError


def test_each_min_rate_bytes_earn_a_second_after_the_timeout() -> None:
    rule = BodyDeadline(timeout=30.0, min_rate=1000.0, start=100.0)
    assert rule.at(0) == 130.0
    assert rule.at(5000) == 135.0
    assert BodyDeadline(timeout=30.0, min_rate=0.0, start=100.0).at(10**9) == 130.0


class Stream:
    total_bytes = 0


def request(stream: Stream) -> Any:
    return SimpleNamespace(content=stream)


async def test_a_body_that_keeps_up_runs_past_the_timeout_and_a_stall_gets_408() -> None:
    config = EdgeConfig(body_timeout=0.05, body_min_rate=1000.0)
    stream = Stream()
    async with deadline(request(stream), config):
        for _ in range(10):  # >= 0.1 s in all (twice the timeout); each step earns 100 s
            stream.total_bytes += 100_000
            await asyncio.sleep(0.01)
    stalled = Stream()
    stalled.total_bytes = 10  # earns 0.01 s
    with pytest.raises(ApiError) as info:
        async with deadline(request(stalled), config):
            await asyncio.Event().wait()  # nothing more arrives
    assert (info.value.status, info.value.code) == (408, "request_timeout")


async def test_another_timeout_inside_is_not_a_408() -> None:
    config = EdgeConfig(body_timeout=60.0)
    with pytest.raises(TimeoutError):
        async with deadline(request(Stream()), config):
            raise TimeoutError("a NATS request timed out")
