"""The OpenAI backend's sans-I/O pieces, without sockets: the SSE passthrough
(``workers.backends.sse``) and the upstream error mapping
(``workers.backends.upstream``). The same code against a real server:
test_openai_backend.py."""

from __future__ import annotations

import pytest

from tidegate.errors import BackendError
from workers.backends.sse import SSEPassthrough
from workers.backends.upstream import status_error


def passthrough(include_usage: bool = False) -> SSEPassthrough:
    return SSEPassthrough(include_usage=include_usage, prompt_tokens=7, model="m")


CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}'
FINISH = b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}'
USAGE = (b'data: {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 22,'
         b' "total_tokens": 33}}')


def test_parser_byte_at_a_time_equals_whole() -> None:
    stream = b"\n\n".join([CHUNK, CHUNK, FINISH, USAGE, b"data: [DONE]", CHUNK]) + b"\n\n"
    whole = passthrough()
    out_whole = whole.feed(stream)
    split = passthrough()
    out_split = b"".join(split.feed(stream[i:i + 1]) for i in range(len(stream)))
    assert out_whole == out_split == b"\n\n".join([CHUNK, CHUNK, FINISH]) + b"\n\n"
    for p in (whole, split):
        assert p.done
        assert p.usage.completion_tokens == 22
        assert p.usage.prompt_tokens == 11
        assert p.finish_reason == "length"


@pytest.mark.parametrize("include_usage", [False, True])
def test_parser_one_event_per_read_equals_whole(include_usage: bool) -> None:
    """One read = one event is the fast path (a token stream's usual read); it
    must see [DONE], usage, finish reasons, errors, CRLF and comments exactly
    as the general path does."""
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}'
    events = [role, CHUNK, b": keep-alive", CHUNK.replace(b'"x"', b'"[DONE] is text"'),
              b"data:" + CHUNK[6:], FINISH, USAGE, b"data: [DONE]", CHUNK]
    reads = [e + b"\n\n" for e in events]
    reads[2] = b": keep-alive\r\n\r\n"
    whole, single = passthrough(include_usage), passthrough(include_usage)
    out_whole = whole.feed(b"".join(reads))
    out_single = b"".join(single.feed(r) for r in reads)
    assert out_single == out_whole
    assert out_single.count(b"\n\n") == (6 if include_usage else 5)  # no comment, no [DONE]
    for p in (whole, single):
        assert p.done
        assert p.events == whole.events
        assert p.usage.completion_tokens == 22
        assert p.finish_reason == "length"
    counted = passthrough()
    for r in reads[:5]:
        counted.feed(r)
    assert counted.usage.completion_tokens == 3  # the role event has no content
    with pytest.raises(BackendError, match="overloaded"):
        passthrough().feed(b'data: {"error": {"message": "overloaded"}}\n\n')


def test_parser_normalises_crlf_and_drops_non_data_lines() -> None:
    p = passthrough(include_usage=True)
    raw = (b": ping\r\n\r\nevent: message\r\nid: 4\r\n" + CHUNK + b"\r\n\r\n"
           + USAGE + b"\r\n\r")
    out = p.feed(raw[:-1]) + p.feed(raw[-1:]) + p.feed(b"\n")
    assert out == CHUNK + b"\n\n" + USAGE + b"\n\n"
    assert p.usage.completion_tokens == 22


def test_parser_estimates_without_usage_and_raises_on_error() -> None:
    p = passthrough()
    role = b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    assert p.feed(role + (CHUNK + b"\n\n") * 3) == role + (CHUNK + b"\n\n") * 3
    assert p.usage.completion_tokens == 3
    assert p.usage.prompt_tokens == 7
    with pytest.raises(BackendError, match="out of memory") as info:
        p.feed(b'data: {"error": {"message": "out of memory", "code": 500}}\n\n')
    assert info.value.status == 502


def test_parser_flush_takes_unterminated_last_event() -> None:
    p = passthrough()
    assert p.feed(FINISH) == b""
    assert p.flush() == FINISH + b"\n\n"
    assert p.finish_reason == "length"


def test_status_error_retry_after() -> None:
    error = status_error(429, "slow down", model="m", retry_after=3.0)
    assert (error.status, error.retry_after, error.retryable) == (429, 3.0, True)
    assert status_error(418, "teapot", model="m").status == 502
