"""What a backend replica says about its own load: KV-cache use and waiting
requests, for cache-aware routing (docs/routing.md).

* vLLM's Prometheus ``/metrics``: ``vllm:kv_cache_usage_perc`` (0..1; older
  releases ``vllm:gpu_cache_usage_perc``) and ``vllm:num_requests_waiting``,
  one series per served model (summed: one server, one cache).
* llama.cpp's ``llama-server`` ``/slots`` (with ``--slots``): a JSON list of
  slots, ``is_processing`` per slot; no free slot counts as waiting.

:func:`parse_vllm_metrics` and :func:`parse_llamacpp_slots` are pure.
:class:`LoadProbe` polls a replica every :data:`PROBE_INTERVAL` seconds and
stops for good once both endpoints answered 404 (a backend that exposes
neither, e.g. Ollama), so it costs nothing there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("tidegate.worker")

PROBE_INTERVAL = 1.0  # seconds between polls of one replica
FRESH = 3  # a report older than this many polls says nothing (a probe that fails)
_TIMEOUT = aiohttp.ClientTimeout(total=2.0)


@dataclass(frozen=True, slots=True)
class BackendLoad:
    kv_usage: float | None = None  # 0..1
    waiting: int | None = None


def parse_vllm_metrics(text: str) -> BackendLoad:
    kv: float | None = None
    waiting: int | None = None
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        # name{labels} value [timestamp]  or  name value [timestamp]
        if "{" in line:
            name, rest = line[:line.index("{")], line[line.rfind("}") + 1:]
        else:
            name, _, rest = line.partition(" ")
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
            kv = max(kv or 0.0, value)
        elif name == "vllm:num_requests_waiting":
            waiting = (waiting or 0) + int(value)
    if kv is not None:
        kv = max(0.0, min(1.0, kv))
    return BackendLoad(kv, waiting)


def parse_llamacpp_slots(data: bytes) -> BackendLoad:
    slots = json.loads(data)
    if not isinstance(slots, list) or not slots:
        return BackendLoad()
    busy = sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing"))
    return BackendLoad(None, 1 if busy >= len(slots) else 0)


class LoadProbe:
    """Polls one replica; :attr:`load` is the latest answer (None fields until
    then, and for what the backend does not report)."""

    def __init__(self, base_url: str, on_change: Callable[[], None] | None = None) -> None:
        # vLLM serves /metrics at the root, beside /v1; so does llama-server /slots.
        self.root = base_url.rstrip("/").removesuffix("/v1")
        self.load = BackendLoad()
        self.load_at = -math.inf  # when :attr:`load` was last read (monotonic)
        self._on_change = on_change

    def idle(self) -> bool:
        """The backend said, within the last few polls, that no request waits
        in it. False where it reports no queue, or has not answered lately."""
        return (self.load.waiting == 0
                and time.monotonic() - self.load_at <= FRESH * PROBE_INTERVAL)

    def _set(self, load: BackendLoad) -> None:
        self.load_at = time.monotonic()
        if load != self.load:
            self.load = load
            if self._on_change is not None:
                self._on_change()

    async def run(self) -> None:
        endpoints = {"metrics": True, "slots": True}
        async with aiohttp.ClientSession(timeout=_TIMEOUT) as session:
            while any(endpoints.values()):
                for name in [n for n, on in endpoints.items() if on]:
                    try:
                        async with session.get(f"{self.root}/{name}") as resp:
                            if resp.status == 404 or resp.status == 501:
                                endpoints[name] = False
                                continue
                            if resp.status != 200:
                                continue
                            body = await resp.read()
                        self._set(parse_vllm_metrics(body.decode("utf-8", "replace"))
                                  if name == "metrics" else parse_llamacpp_slots(body))
                        if name == "metrics" and self.load.kv_usage is None \
                                and self.load.waiting is None:
                            endpoints[name] = False  # Prometheus, but not vLLM's
                        else:
                            endpoints = {name: True}  # this one answers: only it
                        break
                    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                        log.debug("load probe %s/%s: %s", self.root, name, exc)
                await asyncio.sleep(PROBE_INTERVAL)
        log.info("backend %s reports no load (no vLLM /metrics, no /slots); routing uses "
                 "slots only", self.root)
