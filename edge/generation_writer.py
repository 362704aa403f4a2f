"""One generation on a connection that carries many (a WebSocket, a gRPC
call or Session): the two messages such a connection has and SSE does not,
an "accepted" once the request is admitted or its worker starts, and
"queued" with the position while it waits; and the ``Done`` kept for the
generation's own final message. Subclasses say how those two go out
(:meth:`GenerationWriter._send_accepted`, :meth:`GenerationWriter._send_queued`)
and write the rest."""

from __future__ import annotations

from edge.writer import Writer
from tidegate.wire.protocol import Admission, Done, Head, SessionMessage, Status


class GenerationWriter(Writer):
    __slots__ = ("announced", "done_msg", "gen_id")

    announces = True

    def __init__(self, gen_id: str) -> None:
        self.gen_id = gen_id
        self.announced = False  # the "accepted" message went out
        self.done_msg: Done | None = None

    async def notice(self, messages: list[SessionMessage], headers: dict[str, str]) -> None:
        """Messages only such a connection has, before the relay writes what
        follows them. ``headers``: the relay's, which admission's add to."""
        for m in messages:
            kind = type(m)
            if kind is Status:
                assert isinstance(m, Status)
                if m.admission is Admission.REJECTED:
                    continue
                if m.headers:
                    headers.update(m.headers)
                await self._announce(headers)
                if m.admission is Admission.QUEUED and m.position:
                    await self._send_queued(m.position)
            elif kind is Head:
                await self._announce(headers)
            elif kind is Done:
                assert isinstance(m, Done)
                self.done_msg = m

    async def _announce(self, headers: dict[str, str]) -> None:
        if self.announced:
            return
        self.announced = True
        await self._send_accepted({k: v for k, v in headers.items()
                                   if k.startswith("x-ratelimit-")})

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        raise NotImplementedError

    async def _send_queued(self, position: int) -> None:
        raise NotImplementedError
