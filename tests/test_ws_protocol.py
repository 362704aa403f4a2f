"""The WebSocket frame protocol, without sockets (tidegate.wire.ws)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.apis import WEBSOCKET_PATHS as PATHS
from tidegate.errors import ApiError
from tidegate.wire import ws
from tidegate.wire.protocol import Api

# -- parsing client frames ----------------------------------------------------


def parse(frame: Any) -> ws.ClientEvent:
    return ws.parse_client_frame(json.dumps(frame).encode(), PATHS)


def code_of(event: ws.ClientEvent) -> str | None:
    assert isinstance(event, ws.Invalid), event
    return event.error.code


def test_request_frame() -> None:
    event = parse({"type": "request", "id": "a1", "path": "/v1/chat/completions",
                   "body": {"model": "m", "messages": [], "stream": False}})
    assert event == ws.StartRequest("a1", Api.CHAT, {"model": "m", "messages": [],
                                                     "stream": True})


def test_completions_path() -> None:
    event = parse({"type": "request", "id": "a", "path": "/v1/completions", "body": {}})
    assert isinstance(event, ws.StartRequest)
    assert event.api is Api.COMPLETIONS
    assert event.body == {"stream": True}


def test_text_str_and_bytes_parse_alike() -> None:
    raw = '{"type": "cancel", "id": "x"}'
    assert ws.parse_client_frame(raw, PATHS) == ws.parse_client_frame(raw.encode(), PATHS)
    assert ws.parse_client_frame(raw, PATHS) == ws.CancelRequest("x")


@pytest.mark.parametrize(("frame", "expected"), [
    ({"type": "cancel", "id": "x"}, ws.CancelRequest("x")),
    ({"type": "ping"}, ws.Ping()),
    ({"type": "pong"}, ws.Pong()),
    ({"type": "auth", "key": "sk-1"}, ws.Auth("sk-1")),
    ({"type": "resume", "id": "r", "request_id": "abc", "after": 4},
     ws.ResumeRequest("r", "abc", 4)),
    ({"type": "resume", "id": "r", "request_id": "abc"}, ws.ResumeRequest("r", "abc", 0)),
])
def test_other_frames(frame: dict[str, Any], expected: ws.ClientEvent) -> None:
    assert parse(frame) == expected


@pytest.mark.parametrize(("raw", "code", "id"), [
    (b"{nope", "invalid_json", None),
    (b"\xff\xfe", "invalid_json", None),
    (b"NaN", "invalid_json", None),
    (b'{"type": "ping", "x": NaN}', "invalid_json", None),
    (b"[1]", "invalid_frame", None),
    (b'"request"', "invalid_frame", None),
    (b"{}", "invalid_frame", None),
    (b'{"type": 3, "id": "q"}', "invalid_frame", "q"),
    (b'{"type": "subscribe", "id": "q"}', "unknown_type", "q"),
    (b'{"type": "subscribe"}', "unknown_type", None),
    (b'{"type": "auth"}', "invalid_frame", None),
    (b'{"type": "auth", "key": ""}', "invalid_frame", None),
    (b'{"type": "cancel"}', "invalid_id", None),
    (b'{"type": "cancel", "id": 7}', "invalid_id", None),
    (b'{"type": "cancel", "id": ""}', "invalid_id", None),
    (b'{"type": "request", "id": "q", "body": {}}', "unknown_path", "q"),
    (b'{"type": "request", "id": "q", "path": "/v1/embeddings", "body": {}}',
     "unknown_path", "q"),
    (b'{"type": "request", "id": "q", "path": "/v1/completions"}', "invalid_body", "q"),
    (b'{"type": "request", "id": "q", "path": "/v1/completions", "body": []}',
     "invalid_body", "q"),
    (b'{"type": "resume", "id": "q"}', "invalid_frame", "q"),
    (b'{"type": "resume", "id": "q", "request_id": "r", "after": -1}', "invalid_frame", "q"),
    (b'{"type": "resume", "id": "q", "request_id": "r", "after": "3"}', "invalid_frame", "q"),
    (b'{"type": "resume", "id": "q", "request_id": "r", "after": true}', "invalid_frame", "q"),
])
def test_malformed_frames(raw: bytes, code: str, id: str | None) -> None:
    event = ws.parse_client_frame(raw, PATHS)
    assert code_of(event) == code
    assert isinstance(event, ws.Invalid)
    assert event.id == id
    assert event.error.status == 400


def test_binary_frame() -> None:
    assert code_of(ws.parse_client_frame(b'{"type": "ping"}', PATHS, binary=True)) == "binary_frame"
    assert code_of(ws.parse_client_frame(None, PATHS)) == "binary_frame"


def test_id_too_long_is_refused_and_not_echoed() -> None:
    event = parse({"type": "cancel", "id": "x" * (ws.MAX_ID_LENGTH + 1)})
    assert code_of(event) == "invalid_id"
    assert isinstance(event, ws.Invalid)
    assert event.id is None
    assert parse({"type": "cancel", "id": "x" * ws.MAX_ID_LENGTH}) == ws.CancelRequest(
        "x" * ws.MAX_ID_LENGTH)


@given(st.binary(max_size=200))
def test_parse_never_raises(raw: bytes) -> None:
    assert isinstance(ws.parse_client_frame(raw, PATHS),
                      ws.Auth | ws.StartRequest | ws.CancelRequest | ws.ResumeRequest | ws.Ping
                      | ws.Pong | ws.Invalid)


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.sampled_from(["type", "id", "path", "body", "key",
                                                       "after", "request_id"]), c,
                                      max_size=4), max_leaves=10))
def test_parse_never_raises_on_json(value: Any) -> None:
    parse(value)


# -- the socket state machine ---------------------------------------------------


def start(id: str) -> ws.StartRequest:
    return ws.StartRequest(id, Api.CHAT, {})


def test_unauthenticated_socket_takes_only_auth() -> None:
    conn = ws.Connection(4, authenticated=False)
    assert conn.state is ws.SocketState.AUTHENTICATING
    for event in (start("a"), ws.CancelRequest("a"), ws.Ping(),
                  ws.ResumeRequest("a", "r", 0)):
        refused = conn.receive(event)
        assert isinstance(refused, ws.Invalid)
        assert refused.error.type == "authentication_error"
    assert conn.active == set()
    assert conn.receive(ws.Auth("k")) == ws.Auth("k")
    bad = ws.Invalid(ApiError(400, "x", type="invalid_request_error", code="invalid_json"))
    assert conn.receive(bad) is bad  # junk is answered as junk, not as an auth failure
    conn.authenticated()
    assert conn.state is ws.SocketState.OPEN
    assert conn.receive(start("a")) == start("a")


def test_auth_twice() -> None:
    conn = ws.Connection(4, authenticated=True)
    assert code_of(conn.receive(ws.Auth("k"))) == "already_authenticated"


def test_duplicate_ids_and_reuse_after_finish() -> None:
    conn = ws.Connection(4, authenticated=True)
    assert conn.receive(start("a")) == start("a")
    assert code_of(conn.receive(start("a"))) == "duplicate_id"
    assert code_of(conn.receive(ws.ResumeRequest("a", "r", 0))) == "duplicate_id"
    conn.finish("a")
    assert conn.receive(start("a")) == start("a")


def test_max_concurrent() -> None:
    conn = ws.Connection(2, authenticated=True)
    conn.receive(start("a"))
    conn.receive(ws.ResumeRequest("b", "r", 0))
    refused = conn.receive(start("c"))
    assert code_of(refused) == "too_many_concurrent"
    assert isinstance(refused, ws.Invalid)
    assert refused.id == "c"
    assert refused.error.retryable
    assert conn.active == {"a", "b"}
    conn.finish("b")
    assert conn.receive(start("c")) == start("c")


def test_cancel_unknown_id() -> None:
    conn = ws.Connection(2, authenticated=True)
    assert code_of(conn.receive(ws.CancelRequest("a"))) == "unknown_id"
    conn.receive(start("a"))
    assert conn.receive(ws.CancelRequest("a")) == ws.CancelRequest("a")


def test_draining_refuses_new_generations_but_allows_cancel() -> None:
    conn = ws.Connection(2, authenticated=True)
    conn.receive(start("a"))
    conn.drain()
    assert conn.state is ws.SocketState.DRAINING
    assert code_of(conn.receive(start("b"))) == "edge_draining"
    assert conn.receive(ws.CancelRequest("a")) == ws.CancelRequest("a")
    assert conn.receive(ws.Ping()) == ws.Ping()


def test_transitions() -> None:
    conn = ws.Connection(1, authenticated=True)
    conn.authenticated()  # OPEN -> OPEN: a no-op
    conn.drain()
    with pytest.raises(ValueError, match="cannot go"):
        conn.authenticated()  # a draining socket never reopens
    conn.closed()
    conn.drain()  # a closed socket stays closed
    assert conn.state is ws.SocketState.CLOSED
    with pytest.raises(ValueError, match="cannot go"):
        conn.authenticated()


# -- server frames --------------------------------------------------------------


def test_request_frame_opt_in_to_resume() -> None:
    base = {"type": "request", "id": "a", "path": "/v1/completions", "body": {}}
    event = parse({**base, "resumable": True, "resume_grace": 5})
    assert isinstance(event, ws.StartRequest)
    assert event.resumable is True
    assert event.resume_grace == 5.0
    assert parse(base) == ws.StartRequest("a", Api.COMPLETIONS, {"stream": True})
    assert code_of(parse({**base, "resumable": "yes"})) == "invalid_frame"
    assert code_of(parse({**base, "resume_grace": -1})) == "invalid_frame"
    assert code_of(parse({**base, "resume_grace": True})) == "invalid_frame"


def test_reconnect_frame() -> None:
    assert json.loads(ws.reconnect("a", "rid", 7)) == {"type": "reconnect", "id": "a",
                                                        "request_id": "rid", "after": 7}


def test_accepted_done_cancelled_queued() -> None:
    assert json.loads(ws.accepted("a", "rid", {"x-ratelimit-remaining-requests": "9"})) == {
        "type": "accepted", "id": "a", "request_id": "rid",
        "ratelimit": {"x-ratelimit-remaining-requests": "9"}}
    assert json.loads(ws.accepted("a", "rid")) == {"type": "accepted", "id": "a",
                                                   "request_id": "rid"}
    assert json.loads(ws.done("a", 3, 4, "stop")) == {
        "type": "done", "id": "a", "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}}
    assert json.loads(ws.cancelled("a")) == {"type": "cancelled", "id": "a"}
    assert json.loads(ws.queued("a", 5)) == {"type": "queued", "id": "a", "position": 5}
    assert json.loads(ws.PING) == {"type": "ping"}
    assert json.loads(ws.PONG) == {"type": "pong"}


def test_error_frame() -> None:
    err = ApiError(503, "busy", type="service_unavailable", code="overloaded", retryable=True,
                   retry_after=2)
    assert json.loads(ws.error(err, "a")) == {"type": "error", "id": "a", "error": {
        "message": "busy", "type": "service_unavailable", "param": None, "code": "overloaded",
        "retryable": True, "retry_after": 2}}
    plain = json.loads(ws.error(ApiError(400, "bad", type="invalid_request_error")))
    assert "id" not in plain  # about the socket itself
    assert "retryable" not in plain["error"]


def test_ids_are_json_escaped() -> None:
    odd = 'a"b\\c\u2028'
    assert json.loads(ws.cancelled(odd))["id"] == odd
    frames = ws.ChunkFramer(odd).frames(b'data: {"x":1}\n\n')
    assert json.loads(frames[0])["id"] == odd


# -- chunk splicing ---------------------------------------------------------------


def test_chunks_are_spliced_byte_for_byte() -> None:
    framer = ws.ChunkFramer("g1")
    one = b'{"id":"c","choices":[{"delta":{"content":"hi"}}]}'
    two = b'{"id":"c","choices":[{"delta":{"content":" \\u00e9 \\"q\\""}}]}'
    frames = framer.frames(b"data: " + one + b"\n\ndata: " + two + b"\n\n")
    assert frames == [b'{"type":"chunk","id":"g1","seq":1,"data":' + one + b"}",
                      b'{"type":"chunk","id":"g1","seq":2,"data":' + two + b"}"]
    assert framer.seq == 2
    assert framer.frames(b"data:" + one + b"\n\n") == [
        b'{"type":"chunk","id":"g1","seq":3,"data":' + one + b"}"]
    assert json.loads(frames[1])["data"]["choices"][0]["delta"]["content"] == ' \u00e9 "q"'


def test_comments_done_and_empty_events_make_no_frames() -> None:
    framer = ws.ChunkFramer("g")
    assert framer.frames(b"") == []
    assert framer.seq == 0
    # Numbered as the stream log numbers them (every non-empty piece), framed never.
    assert framer.frames(b": ping\n\n") == []
    assert framer.frames(b"data: [DONE]\n\n") == []
    assert framer.frames(b"data: \n\n") == []
    assert framer.seq == 3


def test_seq_matches_the_stream_logs_event_ids() -> None:
    from tidegate.wire.streamlog import EventIds

    chunks = [b'data: {"a":1}\n\n', b'data: {"b":2}\n\ndata: {"c":3}\n\n',
              b'data: {"d":\ndata: 4}\n\n']
    framer, ids = ws.ChunkFramer("g"), EventIds()
    for chunk in chunks:
        seqs = [json.loads(f)["seq"] for f in framer.frames(chunk)]
        framed = ids.frame(chunk)
        assert seqs == [int(line[4:]) for line in framed.split(b"\n")
                        if line.startswith(b"id: ")]
    assert framer.seq == ids.last == 4


def test_multi_line_event_joins_its_data_lines() -> None:
    framer = ws.ChunkFramer("g")
    frames = framer.frames(b'event: x\ndata: {"a":\ndata: 1}\n\n')
    assert frames == [b'{"type":"chunk","id":"g","seq":1,"data":{"a":\n1}}']
    assert json.loads(frames[0])["data"] == {"a": 1}


def test_framer_can_start_after_a_seq() -> None:
    framer = ws.ChunkFramer("g", seq=41)
    assert json.loads(framer.frames(b"data: {}\n\n")[0])["seq"] == 42


@given(st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=10) | st.integers(),
                                max_size=3), min_size=1, max_size=6))
def test_splicing_round_trips(objects: list[dict[str, Any]]) -> None:
    sse = b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objects)
    frames = ws.ChunkFramer("id").frames(sse)
    assert [json.loads(f)["data"] for f in frames] == objects
    assert [json.loads(f)["seq"] for f in frames] == list(range(1, len(objects) + 1))


# -- RFC 6455 framing --------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 125, 126, 127, 65535, 65536, 70000])
def test_text_frame_header(n: int) -> None:
    payload = b"x" * n
    frame = ws.encode_text_frame(payload)
    assert frame[0] == 0x81  # FIN + text
    if n < 126:
        assert frame[1] == n
        assert frame[2:] == payload
    elif n < 65536:
        assert frame[1] == 126
        assert int.from_bytes(frame[2:4], "big") == n
        assert frame[4:] == payload
    else:
        assert frame[1] == 127
        assert int.from_bytes(frame[2:10], "big") == n
        assert frame[10:] == payload


def test_frames_parse_with_a_real_websocket_reader() -> None:
    # python-websockets' own sans-I/O parser reads what we write.
    from websockets.frames import Frame, Opcode
    from websockets.streams import StreamReader

    for payload in (b"{}", b"y" * 300, b"z" * 70000):
        reader = StreamReader()
        reader.feed_data(ws.encode_text_frame(payload))
        reader.feed_eof()
        gen = Frame.parse(reader.read_exact, mask=False)
        try:
            while True:
                next(gen)
        except StopIteration as stop:
            frame = stop.value
        assert frame.opcode is Opcode.TEXT
        assert frame.fin
        assert frame.data == payload


def test_close_frame() -> None:
    frame = ws.close_frame(ws.CloseCode.SERVICE_RESTART, b"bye")
    assert frame == b"\x88\x05\x03\xf4bye"
    assert len(ws.close_frame(1000, b"r" * 500)) == 2 + 2 + 123


# -- keepalive -------------------------------------------------------------------


def keepalive(now: float = 0.0) -> ws.Keepalive:
    return ws.Keepalive(idle_before_ping=10, ping_interval=5, pong_timeout=2, max_missed=2,
                        now=now)


def test_no_ping_while_traffic_flows_either_way() -> None:
    ka = keepalive()
    for t in range(1, 100):
        (ka.sent if t % 2 else ka.received)(float(t))
        assert ka.poll(float(t) + 0.5) is ws.KeepaliveAction.NONE


def test_edge_sending_alone_postpones_pings_forever() -> None:
    ka = keepalive()
    for t in range(1, 100):
        ka.sent(float(t * 9))
        assert ka.poll(float(t * 9) + 1) is ws.KeepaliveAction.NONE


def test_ping_after_idle_then_eviction_after_misses() -> None:
    ka = keepalive()
    assert ka.poll(9.9) is ws.KeepaliveAction.NONE
    assert ka.next_check(9.9) == pytest.approx(0.1)
    assert ka.poll(10.0) is ws.KeepaliveAction.PING
    assert ka.next_check(10.0) == pytest.approx(2.0)
    assert ka.poll(11.9) is ws.KeepaliveAction.NONE
    assert ka.poll(12.0) is ws.KeepaliveAction.NONE  # missed one; next ping waits ping_interval
    assert ka.missed == 1
    assert ka.poll(15.0) is ws.KeepaliveAction.PING
    assert ka.poll(17.0) is ws.KeepaliveAction.EVICT


def test_a_pong_clears_misses() -> None:
    ka = keepalive()
    assert ka.poll(10.0) is ws.KeepaliveAction.PING
    ka.poll(12.0)
    assert ka.missed == 1
    assert ka.poll(15.0) is ws.KeepaliveAction.PING
    ka.received(15.5)
    assert ka.missed == 0
    assert ka.poll(17.0) is ws.KeepaliveAction.NONE
    assert ka.poll(25.5) is ws.KeepaliveAction.PING  # idle again from 15.5


def test_sending_does_not_clear_misses() -> None:
    ka = keepalive()
    ka.poll(10.0)
    ka.poll(12.0)
    assert ka.missed == 1
    ka.sent(12.5)  # tokens to a peer that does not answer
    assert ka.missed == 1
    assert ka.poll(22.5) is ws.KeepaliveAction.PING
    assert ka.poll(24.5) is ws.KeepaliveAction.EVICT


@given(st.lists(st.tuples(st.floats(0, 30), st.sampled_from(["sent", "received", "poll"])),
                max_size=60))
def test_at_most_one_ping_outstanding_and_never_while_busy(
        steps: list[tuple[float, str]]) -> None:
    ka = keepalive()
    now = 0.0
    for dt, what in steps:
        now += dt
        if what == "poll":
            before_traffic = ka.last_traffic
            was_outstanding = ka.outstanding
            action = ka.poll(now)
            if action is ws.KeepaliveAction.PING:
                assert now - before_traffic >= ka.idle_before_ping
                assert not was_outstanding or now - ka.last_ping < 1e-9
            assert ka.next_check(now) >= 0
        else:
            getattr(ka, what)(now)
