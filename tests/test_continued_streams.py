"""A continuing backend's stream spliced onto what the client got
(workers.continuation), unit: a Responses stream's seam at any split of its
bytes, the joined usage and cost of a chat stream, and the end written when
the limit was already reached. The pipeline tests (test_continuation_apis)
see the same through processes mutation testing cannot reach."""

from __future__ import annotations

import dataclasses
import json
from decimal import Decimal
from typing import Any

import pytest

from tests.test_continuation import Chunks, request
from tidegate.control.prices import PRICE_EXTRA, Price, price_spec
from tidegate.wire.protocol import Api, Continue
from workers.backends import Usage
from workers.continuation import (
    Closing,
    ContinuedResponses,
    ContinuedStream,
    JoinedStream,
    _prefix_item,
    _prefix_part,
    continued_stream,
)

NEW_RESPONSE, NEW_ITEM = "resp_new", "msg_new"
CLIENT_RESPONSE, CLIENT_ITEM = "resp_client", "msg_client"


def sse(kind: str, seq: int, **fields: Any) -> bytes:
    body = {"type": kind, "sequence_number": seq, **fields}
    return f"event: {kind}\ndata: {json.dumps(body)}\n\n".encode()


def message(text: str, item: str = NEW_ITEM) -> dict[str, Any]:
    return {"id": item, "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text}]}


def backend_stream() -> bytes:
    """A continuing backend's whole Responses stream: it names its own ids and
    numbers from 0, and knows only its own text (" world")."""
    response = {"id": NEW_RESPONSE, "status": "in_progress", "max_output_tokens": 17}
    return b"".join([
        sse("response.created", 0, response=response),
        sse("response.in_progress", 1, response=response),
        sse("response.output_item.added", 2, output_index=0,
            item={"id": NEW_ITEM, "type": "message", "role": "assistant", "content": []}),
        sse("response.content_part.added", 3, item_id=NEW_ITEM, output_index=0,
            content_index=0, part={"type": "output_text", "text": ""}),
        sse("response.output_text.delta", 4, item_id=NEW_ITEM, delta=" wor"),
        sse("response.output_text.delta", 5, item_id=NEW_ITEM, delta="ld"),
        sse("response.output_text.done", 6, item_id=NEW_ITEM, text=" world"),
        sse("response.content_part.done", 7, item_id=NEW_ITEM,
            part={"type": "output_text", "text": " world"}),
        sse("response.output_item.done", 8, output_index=0, item=message(" world")),
        sse("response.completed", 9, response={
            **response, "status": "completed",
            "output": [{"id": "rs_1", "type": "reasoning"}, message(" world")],
            "usage": {"input_tokens": 10, "output_tokens": 2, "total_tokens": 12}}),
    ])


def split(data: bytes, size: int) -> list[bytes]:
    return [data[i:i + size] for i in range(0, len(data), size)]


async def spliced(go: Continue, size: int, limit: Any = 17) -> list[dict[str, Any]]:
    chunks = Chunks(*split(backend_stream(), size))
    chunks.usage = Usage(prompt_tokens=10, completion_tokens=2)
    stream = ContinuedResponses(chunks, go, limit)
    out = b""
    while data := await stream.read(1 << 16):
        out += data
    assert out.endswith(b"\n\n")
    # The tenant's prompt is the request's own: the delivered tokens this call
    # read again are the operator's.
    assert (stream.usage.prompt_tokens, stream.usage.completion_tokens,
            stream.usage.operator_prompt_tokens) == (10 - go.tokens, 2 + go.tokens, go.tokens)
    events = []
    for block in out.split(b"\n\n")[:-1]:
        lines = block.split(b"\n")
        assert lines[0].startswith(b"event: ")
        events.append(json.loads(lines[1].removeprefix(b"data: ")))
        assert lines[0] == b"event: " + events[-1]["type"].encode()
    return events


# The client got the whole opening and "Hello" in 3 deltas: sequence 0-6.
GOT_ALL = Continue("r1", "Hello", 3, events=7, response_id=CLIENT_RESPONSE,
                   item_id=CLIENT_ITEM, opened=4)


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 16])
async def test_a_continued_responses_stream_goes_on_where_its_client_stopped(size: int) -> None:
    events = await spliced(GOT_ALL, size)
    assert [e["type"] for e in events] == [
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(7, 13))
    assert {e["item_id"] for e in events if "item_id" in e} == {CLIENT_ITEM}
    assert "".join(e["delta"] for e in events[:2]) == " world"
    assert events[2]["text"] == "Hello world"
    assert events[3]["part"] == {"type": "output_text", "text": "Hello world"}
    assert events[4]["item"] == message("Hello world", CLIENT_ITEM)
    response = events[5]["response"]
    assert response["id"] == CLIENT_RESPONSE
    assert response["output"] == [{"id": "rs_1", "type": "reasoning"},
                                  message("Hello world", CLIENT_ITEM)]
    assert response["usage"] == {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12}
    assert response["max_output_tokens"] == 20  # the client's, not the continuation's 17


async def test_the_opening_its_client_missed_is_sent_renamed_and_renumbered() -> None:
    """The client got created and in_progress only (its first worker died
    before the item opened): the item's opening events come, as the client's."""
    go = GOT_ALL._replace(text="", tokens=0, events=2, opened=2)
    events = await spliced(go, 64)
    assert [e["type"] for e in events][:2] == ["response.output_item.added",
                                               "response.content_part.added"]
    assert [e["sequence_number"] for e in events] == list(range(2, 10))
    assert events[0]["item"]["id"] == CLIENT_ITEM
    assert events[-1]["response"]["id"] == CLIENT_RESPONSE
    assert events[-1]["response"]["max_output_tokens"] == 17  # nothing delivered: the same
    assert events[-2]["item"] == message(" world", CLIENT_ITEM)


async def test_without_ids_to_keep_the_backends_pass_and_numbers_still_go_on() -> None:
    go = Continue("r1", "Hello", 3, events=7, opened=4)
    events = await spliced(go, 64, limit=None)
    assert events[-1]["response"]["id"] == NEW_RESPONSE
    assert events[-1]["response"]["max_output_tokens"] is None
    assert [e["sequence_number"] for e in events] == list(range(7, 13))


async def test_a_cut_last_event_passes_as_it_came() -> None:
    whole = backend_stream()
    cut = whole[:whole.rindex(b"event: response.completed") + 40]
    chunks = Chunks(cut)
    chunks.usage = Usage()
    stream = ContinuedResponses(chunks, GOT_ALL, 17)
    out = b""
    while data := await stream.read(1 << 16):
        out += data
    assert out.endswith(cut[-40:])
    assert out.count(b"event: ") == 6


async def test_a_joined_chat_streams_usage_and_cost_are_the_whole_responses() -> None:
    price = Price("m", input=Decimal(2), output=Decimal(10))  # per million tokens
    r = dataclasses.replace(request(), extra={PRICE_EXTRA: price_spec(price, "USD")})
    delta = b'data: {"id":"chatcmpl-new","choices":[{"delta":{"content":" on"}}]}\n\n'
    usage = (b'data: {"id":"chatcmpl-new","choices":[],"usage":{"prompt_tokens":12,'
             b'"completion_tokens":4,"total_tokens":16},"x_tidegate":{"cost":"0","currency":'
             b'"USD"}}\n\n')
    chunks = Chunks(delta, usage)
    chunks.usage = Usage(prompt_tokens=12, completion_tokens=4, finish_reason="stop")
    stream = JoinedStream(chunks, r, Usage(prompt_tokens=8, completion_tokens=3),
                          "chatcmpl-client")
    first = await stream.read(1 << 16)
    assert json.loads(first[6:]) == {"id": "chatcmpl-client",
                                     "choices": [{"delta": {"content": " on"}}]}
    end = json.loads((await stream.read(1 << 16))[6:])
    assert end["id"] == "chatcmpl-client"
    # The request's own prompt: 12 less the 3 delivered tokens read again;
    # those and the broken call's 8 are the operator's, priced to nobody.
    assert end["usage"] == {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}
    assert end["x_tidegate"] == {"cost": "0.000088", "currency": "USD"}  # 9 x 2 + 7 x 10 / 1e6
    assert (stream.usage.prompt_tokens, stream.usage.completion_tokens,
            stream.usage.finish_reason, stream.usage.operator_prompt_tokens) == (9, 7, "stop", 11)
    assert stream.call_usage == chunks.usage
    assert await stream.read(1 << 16) == b""


@pytest.mark.parametrize(("api", "include_usage"), [(Api.CHAT, True), (Api.CHAT, False),
                                                     (Api.COMPLETIONS, True)])
async def test_a_spent_continuation_writes_only_its_end(api: Api, include_usage: bool) -> None:
    r = dataclasses.replace(request(api, max_tokens=3), include_usage=include_usage)
    end = Closing(r, "cmpl-client")
    events = [json.loads(e[6:]) for e in (await end.read(1 << 16)).split(b"\n\n") if e]
    chat = api is Api.CHAT
    last = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"} if chat
            else {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
    assert len(events) == (2 if include_usage else 1)
    for e in events:
        assert (e["id"], e["model"], e["object"]) == (
            "cmpl-client", "m", "chat.completion.chunk" if chat else "text_completion")
        assert isinstance(e["created"], int)
        assert e["created"] > 1_700_000_000
    assert events[0]["choices"] == [last]
    if include_usage:
        assert events[1]["choices"] == []
        assert events[1]["usage"] == {"prompt_tokens": 0, "completion_tokens": 0,
                                      "total_tokens": 0}
    assert (end.usage.completion_tokens, end.usage.finish_reason) == (0, "length")
    assert await end.read(1 << 16) == b""
    await end.aclose()


async def test_a_responses_request_continues_as_its_splice_with_the_clients_limit() -> None:
    r = request(Api.RESPONSES, input="hi", max_output_tokens=17)
    chunks = Chunks(backend_stream())
    chunks.usage = Usage()
    stream = continued_stream(chunks, r, GOT_ALL)
    out = await stream.read(1 << 16)
    assert b'"max_output_tokens": 20' in out or b'"max_output_tokens":20' in out
    assert b"response.created" not in out


async def test_blank_events_and_comments_pass_and_take_no_number() -> None:
    whole = backend_stream()
    at = whole.index(b"event: response.output_text.delta")
    noisy = whole[:at] + b": keep-alive\n\n\n\n" + whole[at:]
    chunks = Chunks(noisy)
    chunks.usage = Usage()
    stream = ContinuedResponses(chunks, GOT_ALL, 17)
    out = b""
    while data := await stream.read(1 << 16):
        out += data
    assert b": keep-alive\n\n" in out
    assert b"\n\n\n\n" not in out
    numbers = [json.loads(b.split(b"\n")[1][6:])["sequence_number"]
               for b in out.split(b"\n\n") if b.startswith(b"event: ")]
    assert numbers == list(range(7, 13))


def test_only_the_first_text_part_of_a_message_gets_the_delivered_text() -> None:
    item = {"type": "message", "content": [{"type": "refusal", "refusal": "no"},
                                           {"type": "output_text", "text": " a"},
                                           {"type": "output_text", "text": " b"}]}
    assert _prefix_item(item, "Hello")
    assert [p.get("text") for p in item["content"]] == [None, "Hello a", " b"]
    assert not _prefix_item({"type": "reasoning", "content": []}, "Hello")
    assert not _prefix_part({"type": "output_text", "text": 5}, "Hello")


async def test_a_continued_chat_stream_carries_the_clients_id_from_its_first_read() -> None:
    role = b'data: {"id":"chatcmpl-new","choices":[{"delta":{"role":"assistant"}}]}\n\n'
    word = b'data: {"id":"chatcmpl-new","choices":[{"delta":{"content":" on"}}]}\n\n'
    s = ContinuedStream(Chunks(role, word, word), chat=True,  # the role chunk read alone
                        response_id="chatcmpl-client")
    first, second = await s.read(100), await s.read(100)
    assert first == second == word.replace(b'"chatcmpl-new"', b'"chatcmpl-client"')
    same = ContinuedStream(Chunks(word), chat=False, response_id="chatcmpl-new")
    assert await same.read(100) == word


async def test_a_usage_event_that_is_not_an_object_passes_unchanged() -> None:
    odd = b'data: [{"usage": {"prompt_tokens": 1}}]\n\n'
    chunks = Chunks(odd)
    chunks.usage = Usage()
    stream = JoinedStream(chunks, request(), Usage(completion_tokens=3))
    assert await stream.read(1 << 16) == odd


async def test_events_written_without_a_space_after_data_are_spliced_too() -> None:
    """``data:{...}`` is as valid SSE as ``data: {...}`` (a backend may write either)."""
    tight = backend_stream().replace(b"data: ", b"data:")
    chunks = Chunks(tight)
    chunks.usage = Usage()
    out = await ContinuedResponses(chunks, GOT_ALL, 17).read(1 << 16)
    assert b'"text":"Hello world"' in out
    usage = (b'data:{"id":"c","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1,'
             b'"total_tokens":2}}\n\n')
    usage_chunks = Chunks(usage)
    usage_chunks.usage = Usage(prompt_tokens=1, completion_tokens=1)
    joined = JoinedStream(usage_chunks, request(), Usage(completion_tokens=3))
    assert b'"completion_tokens":4' in await joined.read(1 << 16)
