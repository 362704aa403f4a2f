# Non-Latin text is the point of these samples, not a look-alike typo.
# ruff: noqa: RUF001
"""tidegate.tokens: the tokenizer-free prompt estimate and the reservation.

``SAMPLES`` are texts written for this test with their true token counts,
recorded once with the real tokenizers (tiktoken 0.14 cl100k_base and
o200k_base, with the vocabulary files matching tiktoken's pinned SHA-256;
llama3-tokenizer-js 1.2), which are not dependencies of tidegate. The bounds
asserted are looser than the documented 5th-95th percentiles because each text
is short; the table in ``tidegate/tokens.py`` was measured on 633 longer chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.apis import completion_cap, estimate_prompt_tokens, reservation
from tidegate.wire.protocol import Api
from tidegate.wire.tokens import estimate_text_tokens

SAMPLES: dict[str, tuple[str, dict[str, int]]] = {
    "english": (
        "A gateway sits between many clients and a few expensive model "
        "servers. It has to decide, for every request, whether it may "
        "run now, later, or not at all. Limits that are counted only "
        "after a response has finished let a burst of concurrent streams "
        "overshoot them, so tidegate reserves the estimated tokens before "
        "the call and settles the difference when the worker reports "
        "what the model actually produced.\n"
        "\n"
        "When the backend slows down, requests wait in a bounded queue "
        "instead of piling up on the model, and each client is told its "
        "position while it waits.",
        {"cl100k": 111, "o200k": 110, "llama3": 111},
    ),
    "python": (
        "async def reserve(self, request_id: str, tokens: int) -> bool:\n"
        "    \"\"\"Charge the tokens, or nothing.\"\"\"\n"
        "    for attempt in range(3):\n"
        "        try:\n"
        "            result = await self._script(keys=[self.key(request_id)], "
        "args=[tokens])\n"
        "        except ConnectionError as exc:\n"
        "            log.warning(\"attempt %d failed: %s\", attempt, exc)\n"
        "            await asyncio.sleep(0.1 * 2 ** attempt)\n"
        "            continue\n"
        "        return bool(result[0])\n"
        "    raise QuotaUnavailable(\"redis did not answer\")\n",
        {"cl100k": 113, "o200k": 113, "llama3": 113},
    ),
    "json": (
        "{\"model\": \"llama-3-8b-instruct\", \"stream\": true, \"max_tokens\": "
        "256, \"messages\": [{\"role\": \"system\", \"content\": \"You are terse.\"}, "
        "{\"role\": \"user\", \"content\": \"List three rivers.\"}], \"metadata\": "
        "{\"tenant\": \"acme-corp\", \"request_id\": \"3f9c2a71-5be0-4d1e-9a44-0c7b18e2d6f5\", "
        "\"tags\": [\"eval\", \"batch-17\", \"2024-06-01T12:30:00Z\"], \"priority\": "
        "2, \"retry\": false}}",
        {"cl100k": 146, "o200k": 146, "llama3": 146},
    ),
    "chinese": (
        "网关位于众多客户端和少数昂贵的模型服务器之间。对于每个请求，它都必须决定是立即运行、稍后运行，还是拒绝。只在响应结束后才计数的限额，"
        "会让大量并发的流式请求超出限制。因此，本系统在调用之前预留估计的令牌数量，并在工作进程报告实际用量之后进行结算。",
        {"cl100k": 129, "o200k": 88, "llama3": 93},
    ),
    "japanese": (
        "ゲートウェイは多くのクライアントと少数の高価なモデルサーバーの間にあります。リクエストごとに、今すぐ実行するか、後で実行するか、"
        "拒否するかを決めなければなりません。バックエンドが遅くなったときは、リクエストは上限のあるキューで待ち、クライアントには順番が通知されます。",
        {"cl100k": 130, "o200k": 105, "llama3": 98},
    ),
    "russian": (
        "Шлюз находится между множеством клиентов и несколькими дорогими "
        "серверами моделей. Для каждого запроса он должен решить, выполнить "
        "ли его сейчас, позже или не выполнять вовсе. Лимиты, которые "
        "считаются только после завершения ответа, позволяют всплеску "
        "одновременных потоков их превысить.",
        {"cl100k": 121, "o200k": 65, "llama3": 78},
    ),
    "german": (
        "Ein Gateway sitzt zwischen vielen Clients und wenigen teuren "
        "Modellservern. Für jede Anfrage muss es entscheiden, ob sie "
        "jetzt, später oder gar nicht ausgeführt wird. Grenzen, die erst "
        "nach dem Ende einer Antwort gezählt werden, lassen gleichzeitige "
        "Datenströme sie überschreiten.",
        {"cl100k": 67, "o200k": 58, "llama3": 67},
    ),
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_close_to_real_tokenizers(name: str) -> None:
    text, true = SAMPLES[name]
    estimate = estimate_text_tokens(text)
    # it follows cl100k, the least efficient of the three on non-English text
    assert 0.75 <= estimate / true["cl100k"] <= 1.25, (estimate, true)
    for tokenizer in ("o200k", "llama3"):
        assert 0.75 <= estimate / true[tokenizer] <= 1.8, (tokenizer, estimate, true)


def test_cjk_counts_about_one_token_per_character() -> None:
    text, true = SAMPLES["chinese"]
    assert len(text) / 4 < 0.4 * true["cl100k"]  # what chars/4 would say
    assert estimate_text_tokens(text) >= 0.8 * len(text)


@pytest.mark.parametrize(("text", "low", "high"), [
    ("", 0, 0),
    ("a", 1, 1),
    ("Hello world!", 2, 4),
    ("The quick brown fox jumps over the lazy dog.", 8, 12),
    ("你好，世界", 4, 6),
    ("1234567890", 4, 10),
    ("😀😀", 2, 6),
    ("\n" * 10, 5, 20),
])
def test_plausible_ranges(text: str, low: int, high: int) -> None:
    assert low <= estimate_text_tokens(text) <= high


@given(st.text(), st.text())
def test_monotonic_and_additive_in_length(a: str, b: str) -> None:
    both = estimate_text_tokens(a + b)
    assert both >= estimate_text_tokens(a)
    assert both >= estimate_text_tokens(b)
    assert both <= estimate_text_tokens(a) + estimate_text_tokens(b)  # ceil at most once


def test_grows_with_repetition() -> None:
    text = SAMPLES["english"][0]
    counts = [estimate_text_tokens(text * k) for k in range(1, 6)]
    assert counts == sorted(counts)
    assert counts[4] == pytest.approx(5 * counts[0], abs=5)


def test_lone_surrogates_do_not_raise() -> None:
    assert estimate_text_tokens("ok \ud800 ok") >= 2


# -- request bodies ------------------------------------------------------------


def chat(*contents: Any, **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": c} for c in contents], **extra}


def test_chat_adds_framing_to_the_text() -> None:
    text = SAMPLES["english"][0]
    as_prompt = estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": text})
    as_chat = estimate_prompt_tokens(Api.CHAT, chat(text))
    assert as_prompt == estimate_text_tokens(text)
    assert as_chat == pytest.approx(as_prompt + 4 + 3, abs=1)  # message + reply priming
    two = estimate_prompt_tokens(Api.CHAT, chat(text, text))
    assert two == pytest.approx(2 * as_prompt + 2 * 4 + 3, abs=1)


def test_chat_content_parts_names_and_tools() -> None:
    plain = estimate_prompt_tokens(Api.CHAT, chat("describe this picture"))
    parts = estimate_prompt_tokens(Api.CHAT, chat([
        {"type": "text", "text": "describe this picture"}, "junk", 7]))
    assert parts == plain
    image = estimate_prompt_tokens(Api.CHAT, chat([
        {"type": "text", "text": "describe this picture"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]))
    assert image > plain + 500

    named = {"messages": [{"role": "user", "name": "alice", "content": "hi"}]}
    assert estimate_prompt_tokens(Api.CHAT, named) > estimate_prompt_tokens(Api.CHAT, chat("hi"))

    call = {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}}]}]}
    assert estimate_prompt_tokens(Api.CHAT, call) >= 4 + 3 + 3 + 5

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    with_tools = estimate_prompt_tokens(Api.CHAT, chat("hi", tools=[tool]))
    assert with_tools > estimate_prompt_tokens(Api.CHAT, chat("hi")) + 15


def test_completions_prompt_forms() -> None:
    assert estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": [1, 2, 3, 4]}) == 4
    assert estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": [[1, 2], [3, 4, 5]]}) == 5
    one = estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": "tide gate"})
    assert estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": ["tide gate"] * 3}) \
        == pytest.approx(3 * one, abs=1)
    with_suffix = estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": "tide", "suffix": " gate"})
    assert with_suffix >= estimate_prompt_tokens(Api.COMPLETIONS, {"prompt": "tide"})
    assert estimate_prompt_tokens(Api.COMPLETIONS, {}) == 0


@given(st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["role", "content", "text", "type", "name", "tool_calls", "function",
                         "arguments", "prompt", "messages"]), inner, max_size=4),
    max_leaves=20))
def test_malformed_bodies_never_raise(value: Any) -> None:
    for body in ({"messages": value}, {"prompt": value}, {"messages": [value]},
                 {"tools": value, "messages": []}, {"n": value, "max_tokens": value}):
        for api in Api:
            assert reservation(api, body, 100) >= 0


# -- reservation ---------------------------------------------------------------------


def test_reservation_is_prompt_plus_completion_cap() -> None:
    body = chat("hello there", max_tokens=50)
    assert reservation(Api.CHAT, body, 1000) == estimate_prompt_tokens(Api.CHAT, body) + 50


@pytest.mark.parametrize(("api", "body", "cap"), [
    (Api.CHAT, {}, 1000),
    (Api.CHAT, {"max_tokens": 50}, 50),
    (Api.CHAT, {"max_completion_tokens": 70}, 70),
    (Api.CHAT, {"max_tokens": 50, "max_completion_tokens": 70}, 50),  # the smaller
    (Api.CHAT, {"max_tokens": True}, 1000),  # a bool is not a number here
    (Api.CHAT, {"max_tokens": -5}, 0),
    (Api.CHAT, {"max_tokens": 10, "n": 3}, 30),
    (Api.COMPLETIONS, {"max_completion_tokens": 70}, 1000),  # not a completions field
    (Api.COMPLETIONS, {"max_tokens": 10, "n": 2, "best_of": 5}, 50),
    (Api.COMPLETIONS, {"max_tokens": 10, "prompt": ["a", "b"]}, 20),
    (Api.COMPLETIONS, {"max_tokens": 10, "prompt": [1, 2, 3]}, 10),  # one prompt as ids
    (Api.COMPLETIONS, {"max_tokens": 10, "prompt": [[1], [2], [3]], "n": 2}, 60),
])
def test_completion_cap(api: Api, body: dict[str, Any], cap: int) -> None:
    assert completion_cap(api, body, 1000) == cap
