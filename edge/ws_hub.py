"""The edge's open WebSockets, for drain and the gauges (one per process).

Kept apart from ``edge/ws.py`` so ``edge/app.py``'s state can hold it without
importing the socket adapter (which imports the app's shared pieces).
"""

from __future__ import annotations

import asyncio
from typing import Protocol


class Socket(Protocol):
    """What the hub needs of an open socket (``edge.ws.WsSocket``)."""

    @property
    def generations(self) -> int: ...

    def drain(self) -> None:
        """No new generations; close with 1012 once the running ones ended."""

    def resumed_tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of its ``resume`` generations (they end by themselves at drain)."""

    async def close_restart(self) -> None:
        """Close now with 1012 (service restart)."""


class WsHub:
    """Open sockets of this edge. Invariant: a socket is in the hub from its
    upgrade until its handler returns."""

    def __init__(self) -> None:
        self._sockets: set[Socket] = set()
        self.draining = False

    def __len__(self) -> int:
        return len(self._sockets)

    def add(self, socket: Socket) -> None:
        self._sockets.add(socket)
        if self.draining:
            socket.drain()

    def remove(self, socket: Socket) -> None:
        self._sockets.discard(socket)

    @property
    def generations(self) -> int:
        return sum(s.generations for s in self._sockets)

    def drain(self) -> None:
        """SIGTERM: every socket stops taking generations; idle ones close at once."""
        self.draining = True
        for socket in list(self._sockets):
            socket.drain()

    async def wait_resumed(self, grace: float) -> None:
        """At drain, after ``StreamLog.drain``: let every ``resume`` generation
        end by itself, with its ``reconnect`` frame after the last chunk it
        sent (its reader sees the drain), before :meth:`close_all` could cut
        it off; at most ``grace`` seconds."""
        tasks = [t for s in list(self._sockets) for t in s.resumed_tasks()]
        if tasks:
            await asyncio.wait(tasks, timeout=grace)

    async def close_all(self) -> None:
        """After the open generations were given their time: close the rest (1012)."""
        await asyncio.gather(*(s.close_restart() for s in list(self._sockets)),
                             return_exceptions=True)
