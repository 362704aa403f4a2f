"""Wire envelopes (tidegate.protocol): round trips and malformed input."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import ProtocolError
from tidegate.wire.protocol import (
    VERSION,
    Ack,
    Admission,
    Api,
    Cancel,
    Chunk,
    Done,
    Error,
    ErrorInfo,
    Head,
    Heartbeat,
    Kind,
    Request,
    Status,
    UsageRecord,
    decode_control,
    decode_session,
)

# msgpack's integer range; JSON numbers beyond it are covered by an xfail below.
ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
seqs = st.integers(min_value=0, max_value=2**63 - 1)
json_scalars = st.none() | st.booleans() | ints | st.floats(allow_nan=False) | st.text()
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(), json_values, max_size=6)
nonempty = st.text(min_size=1, max_size=40)

error_infos = st.builds(
    ErrorInfo,
    status=st.integers(min_value=100, max_value=599),
    type=st.text(max_size=30),
    code=st.text(max_size=30),
    message=st.text(max_size=200),
    retryable=st.booleans(),
    retry_after=st.floats(min_value=0, max_value=1e6, allow_nan=False),
)


def make_request(**overrides: Any) -> Request:
    fields: dict[str, Any] = {
        "id": "req-1",
        "reply": "tg.out.e1.req-1",
        "model": "tidegate-sim",
        "api": Api.CHAT,
        "stream": True,
        "body": {"model": "tidegate-sim", "messages": [{"role": "user", "content": "hi"}]},
        "created_ms": 1_700_000_000_000,
        "deadline_ms": 1_700_000_300_000,
        "window_bytes": 65536,
        "window_msgs": 128,
    }
    fields.update(overrides)
    return Request(**fields)


def request_map(**overrides: Any) -> dict[str, Any]:
    m: dict[str, Any] = msgpack.unpackb(make_request().encode())
    m.update(overrides)
    return m


# --------------------------------------------------------------------------
# Request
# --------------------------------------------------------------------------


def test_request_round_trip_defaults() -> None:
    request = make_request()
    decoded = Request.decode(request.encode())
    assert decoded == request
    assert decoded.api is Api.CHAT
    assert decoded.tenant == "default"
    assert decoded.klass == "interactive"
    assert decoded.include_usage is False
    assert decoded.extra == {}


def test_request_round_trip_all_fields() -> None:
    request = make_request(
        api=Api.COMPLETIONS,
        stream=False,
        include_usage=True,
        tenant="acme",
        user="u1",
        key_id="abcdef012345",
        klass="batch",
        edge="edge-7",
        extra={"trace": "00-abc-def-01", "n": [1, 2]},
    )
    decoded = Request.decode(request.encode())
    assert decoded == request
    assert decoded.api is Api.COMPLETIONS


def test_request_wire_format_is_a_versioned_map() -> None:
    m = msgpack.unpackb(make_request(klass="batch").encode())
    assert m["v"] == VERSION
    assert m["class"] == "batch"
    assert m["api"] == 0
    assert "klass" not in m


@settings(max_examples=150)
@given(
    body=json_objects,
    extra=json_objects,
    rid=nonempty,
    model=nonempty,
    api=st.sampled_from(Api),
    stream=st.booleans(),
    created=st.integers(min_value=0, max_value=2**53),
    window_bytes=st.integers(min_value=1, max_value=2**31),
    window_msgs=st.integers(min_value=1, max_value=2**31),
    tenant=st.text(max_size=20),
)
def test_request_round_trip_property(
    body: dict[str, Any], extra: dict[str, Any], rid: str, model: str, api: Api,
    stream: bool, created: int, window_bytes: int, window_msgs: int, tenant: str,
) -> None:
    request = make_request(id=rid, model=model, api=api, stream=stream, body=body,
                           created_ms=created, deadline_ms=created + 1,
                           window_bytes=window_bytes, window_msgs=window_msgs,
                           tenant=tenant, extra=extra)
    assert Request.decode(request.encode()) == request


@pytest.mark.parametrize("key", ["id", "reply", "model", "api", "stream", "body", "created_ms",
                                 "deadline_ms", "window_bytes", "window_msgs"])
def test_request_missing_required_field(key: str) -> None:
    m = request_map()
    del m[key]
    with pytest.raises(ProtocolError, match="malformed request envelope"):
        Request.decode(msgpack.packb(m))


def test_request_optional_fields_default_when_absent() -> None:
    m = request_map()
    for key in ("include_usage", "tenant", "user", "key_id", "class", "edge", "extra"):
        del m[key]
    decoded = Request.decode(msgpack.packb(m))
    assert decoded == make_request()


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("id", ""),
        ("id", 5),
        ("reply", None),
        ("model", ""),
        ("model", ["m"]),
        ("api", 7),
        ("api", "chat"),
        ("body", []),
        ("body", "text"),
        ("created_ms", "soon"),
        ("created_ms", None),
        ("window_bytes", [1]),
        ("extra", [1, 2]),
    ],
)
def test_request_bad_field_values(key: str, value: Any) -> None:
    with pytest.raises(ProtocolError):
        Request.decode(msgpack.packb(request_map(**{key: value})))


@pytest.mark.parametrize("version", [None, 0, 2, "1"])
def test_request_version_mismatch(version: Any) -> None:
    m = request_map(v=version)
    if version is None:
        del m["v"]
    with pytest.raises(ProtocolError, match="version"):
        Request.decode(msgpack.packb(m))


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", msgpack.packb([1, 2, 3]),
                                  msgpack.packb("text"), msgpack.packb(None)])
def test_request_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        Request.decode(data)


@settings(max_examples=300)
@given(st.binary(max_size=64))
def test_request_decode_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    try:
        Request.decode(data)
    except ProtocolError:
        pass


def test_request_infinite_number_is_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        Request.decode(msgpack.packb(request_map(created_ms=float("inf"))))


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_request_with_integer_outside_64_bits_raises_protocol_error(seed: int) -> None:
    # msgpack carries -2**63 .. 2**64-1; past that, encode() must say so
    # (the edge answers 400), not leak an OverflowError.
    with pytest.raises(ProtocolError):
        make_request(body={"model": "m", "seed": seed}).encode()


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 2**63])
def test_request_with_integer_at_the_64_bit_edges_round_trips(seed: int) -> None:
    request = make_request(body={"model": "m", "seed": seed})
    decoded = Request.decode(request.encode())
    assert decoded == request
    assert decoded.body["seed"] == seed


# --------------------------------------------------------------------------
# Session messages
# --------------------------------------------------------------------------


SESSION_EXAMPLES = [
    Status(Admission.ADMITTED),
    Status(Admission.QUEUED, position=17),
    Status(Admission.REJECTED, error=ErrorInfo(429, "rate_limit_error", "rate_limited",
                                               "slow down", True, 2.5)),
    Head(1, "tg.ctl.w1", 42),
    Head(1, "tg.ctl.w1"),
    Chunk(2, b'data: {"x":1}\n\n'),
    Chunk(3, b""),
    Heartbeat(9),
    Done(10, 12, 34, "stop"),
    Error(4, ErrorInfo(502, "server_error", "backend_error", "boom")),
]


@pytest.mark.parametrize("message", SESSION_EXAMPLES, ids=lambda m: type(m).__name__)
def test_session_round_trip_examples(message: Any) -> None:
    decoded = decode_session(message.encode())
    assert decoded == message
    assert type(decoded) is type(message)


def test_status_fields_after_decode() -> None:
    decoded = decode_session(Status(Admission.QUEUED, position=3).encode())
    assert isinstance(decoded, Status)
    assert decoded.admission is Admission.QUEUED
    assert decoded.position == 3
    assert decoded.error is None
    assert decoded.seq == 0


def test_error_info_types_after_decode() -> None:
    decoded = decode_session(Error(5, ErrorInfo(503, "t", "c", "m", True, 1)).encode())
    assert isinstance(decoded, Error)
    assert decoded.error == ErrorInfo(503, "t", "c", "m", True, 1.0)
    assert isinstance(decoded.error.retry_after, float)
    assert decoded.error.retryable is True


def test_chunk_wire_format() -> None:
    assert msgpack.unpackb(Chunk(7, b"ab").encode()) == [VERSION, Kind.CHUNK, 7, b"ab"]


@given(seq=seqs, data=st.binary(max_size=4096))
def test_chunk_round_trip_property(seq: int, data: bytes) -> None:
    decoded = decode_session(Chunk(seq, data).encode())
    assert decoded == Chunk(seq, data)
    assert isinstance(decoded, Chunk)
    assert isinstance(decoded.data, bytes)


@given(seq=seqs)
def test_heartbeat_round_trip_property(seq: int) -> None:
    assert decode_session(Heartbeat(seq).encode()) == Heartbeat(seq)


@given(seq=seqs, prompt=seqs, completion=seqs, reason=st.text(max_size=20))
def test_done_round_trip_property(seq: int, prompt: int, completion: int, reason: str) -> None:
    assert decode_session(Done(seq, prompt, completion, reason).encode()) == Done(
        seq, prompt, completion, reason)


@given(seq=seqs, control=nonempty, job_seq=seqs)
def test_head_round_trip_property(seq: int, control: str, job_seq: int) -> None:
    assert decode_session(Head(seq, control, job_seq).encode()) == Head(seq, control, job_seq)


@given(seq=seqs, info=error_infos)
def test_error_round_trip_property(seq: int, info: ErrorInfo) -> None:
    assert decode_session(Error(seq, info).encode()) == Error(seq, info)


@given(admission=st.sampled_from(Admission), position=seqs, info=st.none() | error_infos)
def test_status_round_trip_property(admission: Admission, position: int,
                                    info: ErrorInfo | None) -> None:
    message = Status(admission, position, info)
    assert decode_session(message.encode()) == message


@pytest.mark.parametrize("message", [Ack("r1", 5), Cancel("r1", "client_disconnected")])
def test_control_messages_rejected_on_session_subject(message: Any) -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode_session(message.encode())


@pytest.mark.parametrize(
    "data",
    [
        msgpack.packb([VERSION + 1, Kind.CHUNK, 1, b"x"]),
        msgpack.packb([0, Kind.CHUNK, 1, b"x"]),
        msgpack.packb(["1", Kind.CHUNK, 1, b"x"]),
    ],
)
def test_session_version_mismatch(data: bytes) -> None:
    with pytest.raises(ProtocolError, match="version"):
        decode_session(data)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        b"\x94\x01\x02",  # array of 4, truncated
        msgpack.packb([VERSION, Kind.CHUNK, 1, b"x"]) + b"\x00",  # trailing bytes
        msgpack.packb(None),
        msgpack.packb(5),
        msgpack.packb({"v": 1}),
        msgpack.packb([]),
        msgpack.packb([VERSION]),
        msgpack.packb([VERSION, 99, 1]),  # unknown kind
        msgpack.packb([VERSION, Kind.CHUNK, 1]),  # missing data
        msgpack.packb([VERSION, Kind.HEAD, 1, "ctl"]),  # missing job_seq
        msgpack.packb([VERSION, Kind.DONE, 1, 2, 3]),  # missing finish reason
        msgpack.packb([VERSION, Kind.ERROR, 1, [500, "t"]]),  # short error info
        msgpack.packb([VERSION, Kind.ERROR, 1, None]),
        msgpack.packb([VERSION, Kind.STATUS, 0, 9, 0, None]),  # unknown admission
        msgpack.packb([VERSION, Kind.STATUS, 0, 0, 0, "oops"]),
    ],
)
def test_session_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_session(data)


@settings(max_examples=400)
@given(st.binary(max_size=64))
def test_decode_session_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    try:
        decode_session(data)
    except ProtocolError:
        pass


@settings(max_examples=200)
@given(kind=st.integers(min_value=0, max_value=9), rest=st.lists(json_values, max_size=6))
def test_decode_session_random_arrays_only_raise_protocol_error(kind: int, rest: list[Any]
                                                                ) -> None:
    try:
        decode_session(msgpack.packb([VERSION, kind, *rest]))
    except ProtocolError:
        pass


# --------------------------------------------------------------------------
# Control messages
# --------------------------------------------------------------------------


@given(request_id=nonempty, seq=seqs)
def test_ack_round_trip_property(request_id: str, seq: int) -> None:
    decoded = decode_control(Ack(request_id, seq).encode())
    assert decoded == Ack(request_id, seq)
    assert isinstance(decoded, Ack)


@given(request_id=nonempty, reason=st.text(max_size=40))
def test_cancel_round_trip_property(request_id: str, reason: str) -> None:
    decoded = decode_control(Cancel(request_id, reason).encode())
    assert decoded == Cancel(request_id, reason)
    assert isinstance(decoded, Cancel)


def test_ack_wire_format() -> None:
    assert msgpack.unpackb(Ack("r", 3).encode()) == [VERSION, Kind.ACK, 0, "r", 3]


@pytest.mark.parametrize("message", SESSION_EXAMPLES, ids=lambda m: type(m).__name__)
def test_session_messages_rejected_on_control_subject(message: Any) -> None:
    with pytest.raises(ProtocolError, match="unexpected message kind"):
        decode_control(message.encode())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb([VERSION + 1, Kind.ACK, 0, "r", 1]),
        msgpack.packb(None),
        msgpack.packb([VERSION, Kind.ACK, 0, "r"]),  # missing seq
        msgpack.packb([VERSION, Kind.ACK, 0, "r", "x"]),  # seq not an int
        msgpack.packb([VERSION, Kind.CANCEL, 0, "r"]),  # missing reason
        msgpack.packb([VERSION, 42, 0, "r", 1]),
    ],
)
def test_control_garbage(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_control(data)


@settings(max_examples=400)
@given(st.binary(max_size=64))
def test_decode_control_random_bytes_only_raises_protocol_error(data: bytes) -> None:
    try:
        decode_control(data)
    except ProtocolError:
        pass


def test_protocol_error_is_a_tidegate_error() -> None:
    from tidegate.errors import TidegateError

    with pytest.raises(TidegateError):
        decode_control(b"\xc1")


def test_usage_record_round_trip_and_reserved_default() -> None:
    record = UsageRecord(id="r", model="m", outcome="done", prompt_tokens=3,
                         completion_tokens=5, ttft_ms=12.5, reserved=False)
    assert UsageRecord.decode(record.encode()) == record
    # A record from a worker that predates the flag is reconciled (the safe side).
    legacy = msgpack.packb({"v": 1, "id": "r", "model": "m", "outcome": "done"})
    assert UsageRecord.decode(legacy).reserved is True
    with pytest.raises(ProtocolError):
        UsageRecord.decode(b"\x93garbage")
    # A continuation's extra prompt (the operator's) travels; an older record has none.
    continued = dataclasses.replace(record, operator_prompt_tokens=40)
    assert UsageRecord.decode(continued.encode()).operator_prompt_tokens == 40
    assert UsageRecord.decode(legacy).operator_prompt_tokens == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ProtocolError, match="operator_prompt_tokens"):
            UsageRecord.decode(dataclasses.replace(record, operator_prompt_tokens=bad).encode())
