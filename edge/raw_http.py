"""The one place the edge reads aiohttp's private response internals.

aiohttp has no public way to wait for a response's socket to drain, nor to
ask whether a prepared response's body goes out as plain chunked frames.
The relay needs both: the first to slow a worker down to its client
(``edge.relay.Relay._write``), the second to write a chunk's frame from the
NATS callback in one ``transport.write`` (``Relay._direct``, the hot path).
Both read private attributes of aiohttp's ``StreamWriter``
(``_payload_writer``, ``_headers_written``, ``_compress``), so they live
here, behind two functions, and ``tests/test_raw_http.py`` fails the day an
aiohttp upgrade renames them (here they would only turn the fast path off:
an ``AttributeError`` is caught and read as "no").
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.http_writer import StreamWriter


def payload_writer(response: web.StreamResponse) -> StreamWriter | None:
    """The prepared response's writer (``await writer.drain()`` waits for the
    socket to take what was written), or None."""
    writer = getattr(response, "_payload_writer", None)
    return writer if isinstance(writer, StreamWriter) else None


def takes_raw_chunks(response: web.StreamResponse) -> bool:
    """Whether chunked frames written straight to the transport are what
    aiohttp itself would send for this response: headers out, chunked
    transfer encoding (HTTP/1.1), no compression, no content length."""
    writer = payload_writer(response)
    if writer is None:
        return False
    try:
        return bool(writer.chunked and writer._headers_written and writer._compress is None
                    and writer.length is None)
    except AttributeError:  # an aiohttp that renamed them: the relay's own path
        return False
