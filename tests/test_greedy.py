"""Deterministic greedy-model text (issue 25, item 4): token i = f(prompt, i),
and a trailing assistant prefix is continued from where it ends, in the
simulator and in the bench's fake backend."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.fake_backend import FakeBackend, FakeConfig
from tidegate.config import SimulatorConfig
from tidegate.wire.protocol import Api
from workers.backends.greedy import greedy_plan, piece, seed_of
from workers.backends.simulator import plan

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def chat(prefix: str | None = None, **extra: Any) -> dict[str, Any]:
    messages = list(MESSAGES)
    if prefix is not None:
        messages.append({"role": "assistant", "content": prefix})
    return {"model": "m", "messages": messages, **extra}


def test_piece_i_depends_on_the_prompt_and_i_only() -> None:
    seed = seed_of(MESSAGES)
    assert [piece(seed, i) for i in (5, 3, 5)] == [piece(seed, 5), piece(seed, 3), piece(seed, 5)]
    # A shorter answer is the start of a longer one: no state carries over.
    assert list(greedy_plan(True, chat(), 40, 64))[:10] == list(greedy_plan(True, chat(), 10, 64))
    other = seed_of([{"role": "user", "content": "hello"}])
    assert [piece(seed, i) for i in range(8)] != [piece(other, i) for i in range(8)]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(1, 40))
def test_any_prefix_is_continued_to_the_same_text(cut: int, length: int) -> None:
    """Without a limit: prefix + continuation == the whole answer, wherever
    the prefix was cut (between pieces or inside one)."""
    whole = "".join(greedy_plan(True, chat(), None, length))
    cut = min(cut, len(whole))
    rest = greedy_plan(True, chat(whole[:cut]), None, length)
    assert whole[:cut] + "".join(rest) == whole
    assert rest.finish == "stop"


def test_a_reduced_limit_continues_where_the_delivered_pieces_end() -> None:
    whole = list(greedy_plan(True, chat(), 30, 1000))
    rest = greedy_plan(True, chat("".join(whole[:12])), 30 - 12, 1000)
    assert list(rest) == whole[12:]
    assert rest.finish == "length"
    assert rest.resumed == 12


def test_a_prefix_that_is_not_its_own_output_starts_over() -> None:
    whole = "".join(greedy_plan(True, chat(), 10, 64))
    assert "".join(greedy_plan(True, chat("Certainly! "), 10, 64)) == whole


def test_the_simulator_continues_in_deterministic_mode() -> None:
    sim = SimulatorConfig(deterministic=True, length=25)
    whole = "".join(plan(Api.CHAT, chat(), sim, 1000))
    rest = plan(Api.CHAT, chat(whole[:37]), sim, 1000)
    assert whole[:37] + "".join(rest) == whole
    # Off (the default), the text is the seeded sequence of old: a trailing
    # assistant message is just more prompt.
    seeded = "".join(plan(Api.CHAT, chat(), SimulatorConfig(length=25), 1000))
    plain = plan(Api.CHAT, chat(seeded[:37]), SimulatorConfig(length=25), 1000)
    assert "".join(plain) != seeded[37:]


async def stream_text(url: str, body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    async with aiohttp.ClientSession() as session, session.post(
            f"{url}/chat/completions", json={**body, "stream": True}) as resp:
        assert resp.status == 200
        events = [json.loads(line[6:]) async for line in resp.content
                  if line.startswith(b"data: {")]
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"])
    return text, events


async def test_the_fake_backend_continues_byte_exact() -> None:
    async with FakeBackend(FakeConfig(deterministic=True, tokens=30, ttft=0.0,
                                      itl=0.0)) as fake:
        whole, events = await stream_text(fake.base_url, chat())
        rest, more = await stream_text(fake.base_url, chat(whole[:50]))
        again, _ = await stream_text(fake.base_url, chat())
    assert whole[:50] + rest == whole
    assert again == whole
    # id and created come from the prompt: the continued stream's chunks are
    # the same bytes as the uninterrupted stream's.
    assert {(e["id"], e["created"]) for e in events} == {(e["id"], e["created"]) for e in more}
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
