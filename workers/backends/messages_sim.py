"""``POST /v1/messages`` on a backend that answers chat in-process (the
simulator): the request translated to chat (``messages_translate.to_chat``),
the chat stream read and translated back (``messages_sse.MessagesTranslator``),
as the HTTP backend's translation mode does over the wire.
"""

from __future__ import annotations

import dataclasses
import json

from tidegate.apis import estimate_prompt_tokens
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.wire.protocol import Request
from workers.backends.base import BackendStream, Usage
from workers.backends.messages_sse import MessagesTranslator
from workers.backends.messages_translate import to_chat, to_message
from workers.backends.sse import loads

__all__ = ["TranslatedStream"]


class TranslatedStream:
    """A chat :class:`BackendStream` read as a Messages one."""

    def __init__(self, request: Request, inner: BackendStream, stopped_by: str = "") -> None:
        self._inner = inner
        self._stream = request.stream
        self._id = "msg_" + request.id
        self._model = str(request.body.get("model", request.model))
        prompt = estimate_prompt_tokens(request.api, request.body)
        self._translator = MessagesTranslator(prompt_tokens=prompt, model=request.model,
                                              message_id=self._id, client_model=self._model)
        self._usage = self._translator.usage if request.stream else Usage(prompt_tokens=prompt)
        self._ended = False
        # The stop string the answer stopped at, where the inner stream's
        # chunks do not say (vLLM's do, as choice.stop_reason).
        self._translator.matched = stopped_by or None

    @staticmethod
    def chat_request(request: Request, length: int) -> Request:
        """The chat request the inner stream answers (usage always asked for).
        Messages always carries ``max_tokens``, a bound, not a wish: where the
        simulator's chat writes exactly ``max_tokens`` tokens, a bound at or
        above its natural ``length`` is dropped, so it ends its answer there."""
        body = to_chat(request.body, request.model, stream=request.stream)
        limit = body.get("max_tokens")
        if isinstance(limit, int) and limit >= length:
            del body["max_tokens"]
        return dataclasses.replace(request, api=CHAT.api, body=body, include_usage=True)

    @property
    def usage(self) -> Usage:
        return self._usage

    async def read(self, max_bytes: int) -> bytes:
        if self._ended:
            return b""
        if not self._stream:
            raw = bytearray()
            while part := await self._inner.read(1 << 20):
                raw += part
            self._ended = True
            obj = loads(bytes(raw))
            obj = obj if isinstance(obj, dict) else {}
            inner = self._inner.usage
            self._usage.prompt_tokens = inner.prompt_tokens
            self._usage.completion_tokens = inner.completion_tokens
            self._usage.finish_reason = inner.finish_reason
            message = to_message(obj, self._id, self._model)
            if self._translator.matched and message["stop_reason"] == "end_turn":
                message["stop_reason"] = "stop_sequence"
                message["stop_sequence"] = self._translator.matched
            return json.dumps(message, separators=(",", ":")).encode()
        translator = self._translator
        while True:
            data = await self._inner.read(max_bytes)
            out = translator.feed(data) if data else translator.flush()
            if not data:
                self._ended = True
                if not translator.done:
                    out += translator.feed(b"data: [DONE]\n\n")
                return out
            if out:
                return out

    async def aclose(self) -> None:
        self._ended = True
        inner = self._inner.usage
        if not self._stream:
            self._usage.completion_tokens = inner.completion_tokens
        elif not self._translator.done:
            self._usage.completion_tokens = max(self._usage.completion_tokens,
                                                inner.completion_tokens)
        await self._inner.aclose()
