"""Where the edge listens: a port it cannot bind is the user's to fix, not a bug.

A taken ``edge.port`` or ``edge.grpc_port`` (a second edge started with the
same file) ends the process at start with one line naming the key, which
``fleet.run.runtime`` logs without a traceback and exits 1 on
(docs/configuration.md, "Refused at start"). gRPC's own bind failure is a
RuntimeError after a line of its C core on stderr, so its port is probed
first (:func:`ensure_free`); tests/test_config_start.py guards both.
"""

from __future__ import annotations

import errno
import socket

from tidegate.errors import TidegateError


def cannot_listen(key: str, host: str, port: int, exc: OSError) -> TidegateError:
    """The one-line error for a failed bind of ``key`` (``edge.port``, ...)."""
    if isinstance(exc, socket.gaierror):
        return TidegateError(f"edge.host: cannot listen on {host!r}: {exc.strerror or exc}")
    if exc.errno == errno.EADDRINUSE:
        return TidegateError(f"{key}: port {port} on {host or '*'} is in use (another "
                             f"process listens there: give this one another port)")
    return TidegateError(f"{key}: cannot listen on {host or '*'}:{port}: "
                         f"{exc.strerror or exc}")


def ensure_free(key: str, host: str, port: int, *, reuse_port: bool) -> None:
    """Bind and release ``host:port`` the way a listener would, or raise
    :func:`cannot_listen`'s error. Racy by nature: the real bind's failure
    must still be caught, this only spares its noisier report."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        for family, kind, proto, _name, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                # As every listener here sets them: SO_REUSEADDR lets a port
                # in TIME_WAIT be bound, SO_REUSEPORT shares a port on purpose.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port and hasattr(socket, "SO_REUSEPORT"):
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                probe.bind(address)
    except OSError as exc:
        raise cannot_listen(key, host, port, exc) from None
