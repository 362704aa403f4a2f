"""Ports for the servers tidegate starts: which are free, which to pick.

Invariant: a port handed out by :func:`free_port` without a preference lies
below the kernel's ephemeral range, so the source port of an outgoing
connection (thousands of them on a busy machine: a test suite, a fleet) can
not take it in the moment between the pick and the server's bind. A port the
OS picks (bind to 0) comes from that very range, and under load that race
was lost: ``tidegate up`` then failed with "port in use" on a port it chose.
"""

from __future__ import annotations

import random
import socket

# Where picks are drawn when /proc does not say where the ephemeral range
# starts (the IANA dynamic range starts at 49152; Linux's default at 32768).
_LOW = 20_000
_EPHEMERAL_START = 32_768
_TRIES = 200


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when a server could bind ``host:port`` right now.

    Binds with ``SO_REUSEADDR`` like every server tidegate starts does, so a
    port with only TIME_WAIT connections left counts as free; a listening
    socket on it (any address that overlaps ``host``) makes it taken.
    """
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def ephemeral_start() -> int:
    """The first port of the kernel's range for outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_START


def free_port(host: str = "127.0.0.1", preferred: int | None = None) -> int:
    """``preferred`` if it is free on ``host``, else a free port drawn at
    random below the ephemeral range (the OS's pick if none is found there).

    The port is released before returning, so another server could still take
    it before the caller binds it; callers that start servers on it detect
    that as a failed start.
    """
    if preferred and port_is_free(preferred, host):
        return preferred
    top = ephemeral_start()
    if top > _LOW + 1_000:
        for _ in range(_TRIES):
            port = random.randrange(_LOW, top)
            if port_is_free(port, host):
                return port
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        picked: int = s.getsockname()[1]
        return picked


def connect_host(host: str) -> str:
    """An address a client can connect to for a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host
