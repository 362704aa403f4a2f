"""The fake backend's records and settings, apart from its server
(:mod:`bench.fake_backend`) so the route modules it delegates to
(:mod:`bench.fake_responses`) need not import the server back:
:class:`FakeHost` is what they use of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web


@dataclass(slots=True)
class FakeConfig:
    """Pace and shape of the fake model's answers.

    ``models`` is what ``/v1/models`` lists; when non-empty, a request naming
    another model gets 404 as from vLLM. ``keep_output`` makes every record
    keep the exact bytes written (tests compare them; benchmarks should not).
    """

    ttft: float = 0.05
    itl: float = 0.01
    tokens: int = 64  # tokens when the request sets no max_tokens
    token_size: int = 4  # bytes of text per token
    models: tuple[str, ...] = ()
    keep_output: bool = False
    max_records: int = 100_000  # oldest records are dropped past this
    # Serve /v1/responses and /v1/embeddings (bench.fake_responses);
    # off, the path is not routed, as on a backend that lacks the endpoint.
    responses: bool = True
    embeddings: bool = True
    messages: bool = True  # serve Anthropic's /v1/messages (bench.fake_messages)
    tool_calls: bool = False  # answer chat requests with tools by a tool call (ditto)
    # A prefix (KV) cache model: the first token waits this many seconds per
    # prompt character the cache did not hold (0 = no model, ttft only).
    prefill_per_char: float = 0.0
    cache_blocks: int = 4096  # the cache's size in 256-character blocks
    saturate_at: int = 0  # K: past K concurrent streams the pace slows by N / K (0 = never)
    report_load: bool = False  # serve vLLM-style /metrics (kv_usage, waiting)
    # Greedy-model text (workers/backends/greedy.py): token i = f(prompt, i), a
    # trailing assistant message continued, id and created from the prompt:
    # an interrupted and continued stream is byte-exact against a whole one.
    deterministic: bool = False
    # A replica that fails mid-stream, for every chat/completions stream (a
    # request's own x-fake-fail-after wins): after ``fail_after`` events
    # (the chat role chunk counts; -1 = never), "drop" closes the connection
    # with the chunked body unfinished (a killed process, a reset), "error"
    # sends an error event as vLLM does for a 5xx mid-stream, then [DONE].
    fail_after: int = -1
    fail_with: str = "drop"
    # A replica alive but unwell: every generation answered with this HTTP
    # status (0 = none; a request's x-fake-status wins). A test may set it on
    # a running fake to make it fall sick and heal.
    status: int = 0


@dataclass(slots=True)
class FakeRecord:
    """What the fake saw and did for one generation request.

    Times are ``time.monotonic()``. ``closed_at`` is set only when the *client*
    closed the connection before the response was complete (a write failed or
    the server noticed the connection was lost); an injected drop does not set it.
    """

    id: int
    path: str
    started_at: float
    headers: dict[str, str]
    peer: str = ""  # client "host:port": equal peers mean a reused connection
    body: dict[str, Any] = field(default_factory=dict)
    status: int = 200
    bytes_written: int = 0
    events_written: int = 0
    completed: bool = False
    dropped: bool = False  # the fake dropped the connection (x-fake-fail-after)
    closed_at: float | None = None
    finished_at: float | None = None
    first_byte_at: float | None = None  # when the first token's event was written
    # The slow-down factor (FakeBackend.load) the first token was paced with:
    # the congestion the stream met, apart from the machine's own delays.
    slowdown: float = 1.0
    output: bytearray = field(default_factory=bytearray)
    prompt_chars: int = 0  # with the prefix-cache model: the prompt's size
    cached_chars: int = 0  # and how much of it the cache held


@dataclass(slots=True)
class _Faults:
    status: int = 0
    message: str = ""
    fail_after: int = -1
    ttft: float | None = None
    itl: float | None = None
    header_delay: float = 0.0
    cached_tokens: int = 0  # reported as usage.prompt_tokens_details.cached_tokens

    @classmethod
    def parse(cls, headers: Mapping[str, str], body: Mapping[str, Any]) -> _Faults:
        def get(name: str, default: Any = None) -> Any:
            value = headers.get(f"x-fake-{name}")
            if value is None:
                value = body.get("fake_" + name.replace("-", "_"))
            return default if value is None else value

        return cls(
            status=int(get("status", 0)),
            message=str(get("message", "")),
            fail_after=int(get("fail-after", -1)),
            ttft=_opt_float(get("ttft")),
            itl=_opt_float(get("itl")),
            header_delay=float(get("header-delay", 0.0)),
            cached_tokens=int(get("cached-tokens", 0)),
        )


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


class FakeHost(Protocol):
    """What a route module of the fake uses of :class:`FakeBackend`."""

    config: FakeConfig
    _texts: list[str]

    def _error(self, record: FakeRecord, status: int, message: str) -> web.Response: ...

    async def _write(self, resp: web.StreamResponse, record: FakeRecord,
                     data: bytes) -> None: ...
