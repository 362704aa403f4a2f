"""The edge's patient request publish (edge.publish.publish_patiently), with a fake JetStream.

What a real NATS node's death does to it is in the chaos run
(tests/test_chaos.py, docs/reliability.md); here each branch of the retry
rule: transient failures are retried within ``edge.publish_patience``, an
answer (a full stream) is not, and a closed connection is not waited on.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from edge.publish import publish_patiently
from tidegate import config as tgconfig


class _Js:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[dict[str, str]] = []
        self.times: list[float] = []  # the event loop's clock at each call

    async def publish(self, subject: str, payload: bytes, headers: dict[str, str]) -> Any:
        self.calls.append(headers)
        self.times.append(asyncio.get_running_loop().time())
        if self.failures:
            raise self.failures.pop(0)
        return SimpleNamespace(seq=len(self.calls))


def _state(js: _Js, patience: float, closed: bool = False) -> Any:
    config = tgconfig.from_dict({"edge": {"publish_patience": patience}})
    return SimpleNamespace(js=js, nc=SimpleNamespace(is_closed=closed), config=config)


def retried_while_patient(js: _Js, deadline: float) -> None:
    """Retried 0.25 s apart while a retry still fitted before ``deadline``,
    and not once more. Judged on the clock the calls saw: a loaded machine
    that wakes the retries late changes how many fit, not the rule."""
    assert js.times
    assert all(b - a >= 0.24 for a, b in zip(js.times, js.times[1:], strict=False))
    assert all(t + 0.25 < deadline for t in js.times[:-1])
    assert js.times[-1] + 0.25 >= deadline


def _api_error(code: int, description: str) -> nats.js.errors.APIError:
    return nats.js.errors.APIError(code=code, description=description)


async def test_no_pubacks_are_retried_with_the_same_message_id() -> None:
    js = _Js([nats.errors.NoRespondersError(), nats.errors.TimeoutError(),
              _api_error(503, "JetStream system temporarily unavailable")])
    ack = await publish_patiently(_state(js, 5.0), "s", b"x", {"Nats-Msg-Id": "r-1"})
    assert ack.seq == 4
    assert [h["Nats-Msg-Id"] for h in js.calls] == ["r-1"] * 4  # dedup makes it safe


async def test_a_full_stream_is_an_answer_not_retried() -> None:
    js = _Js([_api_error(503, "maximum messages exceeded")])
    with pytest.raises(nats.js.errors.APIError):
        await publish_patiently(_state(js, 5.0), "s", b"x", {"Nats-Msg-Id": "r-1"})
    assert len(js.calls) == 1


async def test_patience_runs_out_and_zero_means_at_once() -> None:
    js = _Js([nats.errors.TimeoutError()] * 100)
    started = asyncio.get_running_loop().time()
    with pytest.raises(nats.errors.TimeoutError):
        await publish_patiently(_state(js, 0.6), "s", b"x", {"Nats-Msg-Id": "r-1"})
    assert 2 <= len(js.calls) <= 3
    retried_while_patient(js, started + 0.6)
    once = _Js([nats.errors.TimeoutError()])
    with pytest.raises(nats.errors.TimeoutError):
        await publish_patiently(_state(once, 0.0), "s", b"x", {"Nats-Msg-Id": "r-2"})
    assert len(once.calls) == 1


async def test_a_closed_connection_is_not_waited_on() -> None:
    js = _Js([nats.errors.ConnectionClosedError()])
    with pytest.raises(nats.errors.ConnectionClosedError):
        await publish_patiently(_state(js, 5.0, closed=True), "s", b"x", {"Nats-Msg-Id": "r"})
    assert len(js.calls) == 1


def test_patience_is_not_negative_and_leaves_the_dispatcher_time() -> None:
    with pytest.raises(tgconfig.ConfigError, match="publish_patience"):
        tgconfig.from_dict({"edge": {"publish_patience": -1}})
    # Above half the admission timeout it is capped there, not refused.
    assert tgconfig.from_dict({"edge": {"publish_patience": 30.0}}).edge.publish_patience == 30.0


async def test_patience_is_capped_at_half_the_admission_timeout() -> None:
    js = _Js([nats.errors.TimeoutError()] * 100)
    state = _state(js, 20.0)
    state.config = tgconfig.from_dict({"edge": {"publish_patience": 20.0,
                                                "admission_timeout": 1.2},
                                       "dispatcher": {"ack_wait": 1.0}})
    started = asyncio.get_running_loop().time()
    with pytest.raises(nats.errors.TimeoutError):
        await publish_patiently(state, "s", b"x", {"Nats-Msg-Id": "r-1"})
    retried_while_patient(js, started + 0.6)  # half of 1.2 s, not 20 s
