"""TCP keepalive on client sockets (edge.state.set_keepalive), on real sockets."""

from __future__ import annotations

import asyncio
import socket

import pytest

from edge.state import set_keepalive
from tidegate.config import EdgeConfig

pytestmark = pytest.mark.skipif(not hasattr(socket, "TCP_KEEPIDLE"),
                                reason="Linux keepalive options")


async def _server_transports(n: int) -> tuple[list[asyncio.BaseTransport], asyncio.Server,
                                               list[asyncio.StreamWriter]]:
    accepted: list[asyncio.BaseTransport] = []
    got = asyncio.Event()

    async def on_client(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.transport)
        if len(accepted) == n:
            got.set()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    clients = [(await asyncio.open_connection("127.0.0.1", port))[1] for _ in range(n)]
    async with asyncio.timeout(5):
        await got.wait()
    return accepted, server, clients


def _options(transport: asyncio.BaseTransport) -> tuple[int, int, int, int]:
    sock = transport.get_extra_info("socket")
    return (sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT))


async def test_keepalive_is_set_from_config_once_per_connection() -> None:
    (first, second), server, clients = await _server_transports(2)
    try:
        config = EdgeConfig(keepalive_idle=31, keepalive_interval=7, keepalive_count=4)
        set_keepalive(first, config)
        assert _options(first) == (1, 31, 7, 4)
        # The same connection's next request does not set it again (a changed
        # config would only reach new connections)...
        set_keepalive(first, EdgeConfig(keepalive_idle=99, keepalive_interval=9,
                                        keepalive_count=9))
        assert _options(first) == (1, 31, 7, 4)
        # ...but every new connection gets it.
        set_keepalive(second, config)
        assert _options(second) == (1, 31, 7, 4)
    finally:
        for writer in clients:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_keepalive_off_leaves_the_socket_alone() -> None:
    (transport,), server, clients = await _server_transports(1)
    try:
        set_keepalive(transport, EdgeConfig(keepalive_idle=0))
        assert _options(transport)[0] == 0
    finally:
        for writer in clients:
            writer.close()
        server.close()
        await server.wait_closed()
