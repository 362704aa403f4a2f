"""Untrusted broker input without sockets: decoders and drop accounting."""

from __future__ import annotations

import logging

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import ProtocolError
from tidegate.telemetry.untrusted import RateLimitedLog
from tidegate.wire.mux import decode_mux
from tidegate.wire.protocol import VERSION, Request, UsageRecord, decode_control, decode_session

DECODERS = [decode_session, decode_control, Request.decode, UsageRecord.decode, decode_mux]

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=10) | st.binary(max_size=10),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=6),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_protocol_error(data: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(data)
        except ProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 9), _values, _values, _values, _values)
def test_well_framed_envelopes_with_wrong_types_raise_protocol_error(
        kind: int, a: object, b: object, c: object, d: object) -> None:
    for envelope in ([VERSION, kind, a, b, c, d], [VERSION, kind, a, b],
                     {"v": VERSION, "id": a, "reply": b, "model": c, "body": d, "api": a}):
        data = msgpack.packb(envelope)
        for decode in DECODERS:
            try:
                decode(data)
            except ProtocolError:
                pass


def test_rate_limited_log_writes_one_line_per_key_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = RateLimitedLog(logging.getLogger("tidegate.test"), interval=10.0,
                         clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, "tidegate.test"):
        written = [log.warning("a", "bad %s", i) for i in range(1000)]
        assert written.count(True) == 1
        assert log.warning("b", "other key")
        now[0] = 10.5
        assert log.warning("a", "again")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["bad 0", "other key", "again (999 more suppressed)"]
