"""One generation on a connection that carries many (a WebSocket, a gRPC
call or Session): the relay of :class:`edge.relay.Relay`, plus the two
messages such a connection has and SSE does not, an "accepted" once the
request is admitted or its worker starts, and "queued" with the position
while it waits; and the ``Done`` kept for the generation's own final
message. Subclasses say how those two go out (:meth:`_send_accepted`,
:meth:`_send_queued`) and write the rest."""

from __future__ import annotations

from edge.relay import Relay
from tidegate.wire.protocol import Admission, Done, Head, SessionMessage, Status


class GenerationRelay(Relay):
    __slots__ = ("announced", "done_msg", "gen_id")

    gen_id: str
    announced: bool  # the "accepted" message went out
    done_msg: Done | None

    async def _handle(self, messages: list[SessionMessage], now: float) -> bool:
        # Messages only such a connection has, before the relay writes what
        # follows them.
        for m in messages:
            kind = type(m)
            if kind is Status:
                assert isinstance(m, Status)
                if m.admission is Admission.REJECTED:
                    continue
                if m.headers:
                    self.headers.update(m.headers)
                await self._announce()
                if m.admission is Admission.QUEUED and m.position:
                    await self._send_queued(m.position)
            elif kind is Head:
                await self._announce()
            elif kind is Done:
                assert isinstance(m, Done)
                self.done_msg = m
        return await super()._handle(messages, now)

    async def _announce(self) -> None:
        if self.announced:
            return
        self.announced = True
        await self._send_accepted({k: v for k, v in self.headers.items()
                                   if k.startswith("x-ratelimit-")})

    async def _send_accepted(self, ratelimit: dict[str, str]) -> None:
        raise NotImplementedError

    async def _send_queued(self, position: int) -> None:
        raise NotImplementedError
