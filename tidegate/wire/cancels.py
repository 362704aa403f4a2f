"""Recently cancelled request ids, bounded in size and time (sans-I/O).

Dispatchers and workers subscribe to the cancel broadcast and remember ids
here, so a request cancelled while it still waits in a stream is dropped when
it comes up instead of running for a client that is gone. Entries expire after
``ttl`` seconds and the oldest are evicted past ``max_entries``, so memory is
bounded whatever the cancel rate. (The KV tombstone that makes this survive a
restart is the cancellation issue's work; this is the in-process half.)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable


class CancelRegistry:
    def __init__(self, ttl: float = 3600.0, max_entries: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl = ttl
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: str) -> None:
        now = self._clock()
        self._entries[request_id] = now + self._ttl
        self._entries.move_to_end(request_id)
        self._expire(now)

    def __contains__(self, request_id: object) -> bool:
        expires = self._entries.get(request_id)  # type: ignore[call-overload]
        return expires is not None and expires > self._clock()

    def _expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            oldest, expires = next(iter(entries.items()))
            if expires > now and len(entries) <= self._max:
                break
            del entries[oldest]
