"""ResponsesPassthrough: Responses API SSE relayed byte for byte, sequence
numbers spliced in where missing, usage from the terminal event (sans-I/O)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tidegate.errors import BackendError
from workers.backends.responses_sse import ResponsesPassthrough, _splice
from workers.backends.upstream import is_missing_endpoint


def event(kind: str, seq: int | None, **fields: object) -> bytes:
    head: dict[str, object] = {"type": kind}
    if seq is not None:
        head["sequence_number"] = seq
    return (b"event: " + kind.encode() + b"\ndata: "
            + json.dumps({**head, **fields}).encode() + b"\n\n")


def stream(seq: bool = True, tokens: int = 3, terminal: str = "response.completed") -> bytes:
    n = 0

    def nxt() -> int | None:
        nonlocal n
        n += 1
        return n - 1 if seq else None

    out = event("response.created", nxt(), response={"id": "r", "output": []})
    out += event("response.output_item.added", nxt(), output_index=0,
                 item={"type": "message", "id": "m", "content": []})
    for i in range(tokens):
        out += event("response.output_text.delta", nxt(), delta=f" w{i}", item_id="m",
                     output_index=0, content_index=0)
    status = "completed" if terminal == "response.completed" else "incomplete"
    details = None if status == "completed" else {"reason": "max_output_tokens"}
    out += event(terminal, nxt(), response={
        "id": "r", "status": status, "incomplete_details": details,
        "output": [{"type": "message", "content": [{"type": "output_text", "text": "x"}]}],
        "usage": {"input_tokens": 11, "output_tokens": 42, "total_tokens": 53}})
    return out


def parser() -> ResponsesPassthrough:
    return ResponsesPassthrough(prompt_tokens=5, model="m")


def test_numbered_stream_passes_unchanged_and_reports_usage() -> None:
    raw = stream()
    p = parser()
    assert p.feed(raw) == raw
    assert p.done
    assert p.spliced == 0
    assert (p.usage.prompt_tokens, p.usage.completion_tokens) == (11, 42)
    assert p.finish_reason == "stop"


def test_intact_read_is_the_input_object() -> None:
    raw = event("response.output_text.delta", 4, delta="x")
    p = parser()
    assert p.feed(raw) is raw  # no copy on the common path
    assert p.usage.completion_tokens == 1


def test_missing_sequence_numbers_are_spliced_not_reencoded() -> None:
    raw = stream(seq=False)
    p = parser()
    out = p.feed(raw)
    assert re.findall(rb'"sequence_number":(\d+)', out) == [b"%d" % i for i in range(6)]
    assert re.sub(rb'"sequence_number":\d+,', b"", out) == raw
    assert p.spliced == 6
    for chunk in out.split(b"\n\n")[:-1]:
        obj = json.loads(chunk.split(b"data: ", 1)[1])
        assert next(iter(obj)) == "sequence_number"


def test_incomplete_maps_to_length() -> None:
    p = parser()
    p.feed(stream(terminal="response.incomplete"))
    assert p.done
    assert p.finish_reason == "length"


def test_deltas_count_until_the_terminal_event() -> None:
    raw = stream(tokens=5)
    cut = raw.index(b"event: response.completed")
    p = parser()
    p.feed(raw[:cut])
    assert p.usage.completion_tokens == 5  # a cancelled stream reconciles this
    assert not p.done
    p.feed(raw[cut:])
    assert p.usage.completion_tokens == 42


def test_done_marker_and_bytes_after_the_terminal_event_are_dropped() -> None:
    raw = stream()
    p = parser()
    assert p.feed(raw + b"data: [DONE]\n\n") == raw
    assert p.feed(b"data: {}\n\n") == b""
    p2 = parser()
    assert p2.feed(b"data: [DONE]\n\n") == b""
    assert p2.done


def test_comments_ids_and_crlf() -> None:
    body = b'{"type":"response.output_text.delta","sequence_number":1,"delta":"a"}'
    p = parser()
    out = p.feed(b": keepalive\r\n\r\nid: 7\r\nevent: response.output_text.delta\r\ndata: "
                 + body + b"\r\n\r\n")
    assert out == b"event: response.output_text.delta\ndata: " + body + b"\n\n"


def test_error_event_raises() -> None:
    p = parser()
    with pytest.raises(BackendError, match="overloaded"):
        p.feed(event("error", 3, code="server_error", message="overloaded"))


def test_unterminated_last_event_is_flushed() -> None:
    p = parser()
    assert p.feed(b'data: {"type":"response.created"}') == b""
    assert p.flush() == b'data: {"sequence_number":0,"type":"response.created"}\n\n'


def test_splice_edge_cases() -> None:
    assert _splice(b"data: {}", 3) == b'data: {"sequence_number":3}'
    assert _splice(b"data:{ }", 3) == b'data:{"sequence_number":3 }'
    assert _splice(b"event: x\ndata: [1]", 3) == b"event: x\ndata: [1]"
    assert _splice(b'event: x\ndata: {"a":1}', 0) == b'event: x\ndata: {"sequence_number":0,"a":1}'


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=400), max_size=30), st.booleans())
def test_any_read_boundaries_give_the_same_output(cuts: list[int], seq: bool) -> None:
    raw = stream(seq=seq, tokens=4)
    whole = parser().feed(raw)
    p = parser()
    out, pos = b"", 0
    for size in cuts:
        out += p.feed(raw[pos:pos + size])
        pos += size
    out += p.feed(raw[pos:]) + p.flush()
    assert out == whole
    assert p.usage.completion_tokens == 42


def test_missing_endpoint_heuristic() -> None:
    assert is_missing_endpoint(404, "Not Found")
    assert is_missing_endpoint(404, "File Not Found")
    assert is_missing_endpoint(404, "404 page not found")
    assert is_missing_endpoint(405, "Method Not Allowed")
    assert is_missing_endpoint(501, "anything")
    assert not is_missing_endpoint(404, "The model `x` does not exist.")
    assert not is_missing_endpoint(400, "bad")


def test_background_stream_gets_tidegate_response_id() -> None:
    """A background response's events name tidegate's id (resp_<request id>)
    instead of the backend's, everywhere it appears, and nothing else changes."""
    raw = stream()  # the backend's id is "r"
    p = ResponsesPassthrough(prompt_tokens=5, model="m", rename=b"resp_abc")
    out = p.feed(raw)
    assert out == raw.replace(b'"id": "r"', b'"id": "resp_abc"')
    assert out.count(b'"resp_abc"') == raw.count(b'"id": "r"') == 2
    assert parser().feed(raw) == raw  # not background: untouched
