"""Session affinity, sans-I/O: the key a request's prefix cache lives under, and
which backend replica a request should go to.

:func:`affinity_key`: the client's ``prompt_cache_key`` when it sends one; else
a hash of the conversation's stable prefix (system/developer messages and the
first user message; the start of a completion prompt), at most
``prefix_bytes`` bytes, with ``user`` mixed in when ``routing.key_user`` says
so. No usable text, no key: the shared queue.

:func:`choose` answers with a :class:`Route` (a replica's queue or the shared
one, and why): the key's home while it has room, or while the wait for its
slot is shorter than the prefill its cache saves (:meth:`ReplicaLoad.worth_waiting`);
a key without a home goes to the best rendezvous score weighted by headroom, so
two dispatchers pick the same replica. Docs: docs/routing.md.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from tidegate.wire.subjects import encode_token

#: Bytes of prefix text hashed at most (``routing.prefix_bytes``'s default).
PREFIX_BYTES = 4096

#: NATS header on a job: its affinity key (the replica that takes it becomes
#: the key's home).
AFFINITY_HEADER = "Tg-Affinity"
#: NATS header on a job that may exist twice (routed to a replica's queue, and
#: a fallback copy on the shared queue): its value names the copy, and a worker
#: runs it only after claiming the request id for that copy.
CLAIM_HEADER = "Tg-Claim"
#: NATS header on a routed job: the :class:`Reason` it went where it went.
ROUTE_HEADER = "Tg-Route"
CLAIM_ROUTED = "routed"
CLAIM_FALLBACK = "fallback"

# Roles that make up a conversation's stable prefix ahead of the first user turn.
_PREAMBLE_ROLES = frozenset({"system", "developer"})


def affinity_key(field: str | None, body: Mapping[str, Any], *, user: bool = False,
                 prefix_bytes: int = PREFIX_BYTES) -> str | None:
    """The request's affinity key (hex, 64 bits), or ``None`` when it has none.
    ``field`` holds its prompt (its dialect's ``affinity_field``): ``"messages"``
    is read as chat turns, another as completions' prompt, None as nothing."""
    h = hashlib.blake2b(digest_size=8)
    cache_key = body.get("prompt_cache_key")
    if isinstance(cache_key, str) and cache_key:
        h.update(b"k\0")
        h.update(cache_key[:prefix_bytes].encode("utf-8", "surrogatepass"))
    else:
        budget = _Budget(h, prefix_bytes)
        if field == "messages":
            _chat_prefix(body.get("messages"), budget)
        elif field is not None:
            _prompt_prefix(body.get(field), budget)
        if budget.used == 0:
            return None
    if user:
        name = body.get("user")
        if isinstance(name, str) and name:
            h.update(b"\0u\0")
            h.update(name[:256].encode("utf-8", "surrogatepass"))
    return h.hexdigest()


class _Budget:
    """Feeds text into the hash until ``limit`` bytes have gone in."""

    __slots__ = ("h", "limit", "used")

    def __init__(self, h: Any, limit: int) -> None:
        self.h = h
        self.limit = limit
        self.used = 0

    @property
    def full(self) -> bool:
        return self.used >= self.limit

    def add(self, text: str) -> None:
        if self.full or not text:
            return
        # Cut the str before encoding: a 10 MB prompt is never encoded whole.
        data = text[: self.limit - self.used].encode("utf-8", "surrogatepass")
        data = data[: self.limit - self.used]
        self.h.update(data)
        self.used += len(data)


def _chat_prefix(messages: Any, budget: _Budget) -> None:
    if not isinstance(messages, list):
        return
    for message in messages:
        if budget.full or not isinstance(message, Mapping):
            return
        role = message.get("role")
        if not isinstance(role, str) or (role not in _PREAMBLE_ROLES and role != "user"):
            # An assistant or tool message before any user turn: the prefix
            # is what came before it.
            return
        budget.h.update(role.encode() + b"\0")
        _content(message.get("content"), budget)
        budget.h.update(b"\0")
        if role == "user":
            return  # the first user turn ends the stable prefix


def _content(content: Any, budget: _Budget) -> None:
    if isinstance(content, str):
        budget.add(content)
    elif isinstance(content, list):
        for part in content:
            if budget.full:
                return
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                budget.add(part["text"])


def _prompt_prefix(prompt: Any, budget: _Budget) -> None:
    if isinstance(prompt, str):
        budget.add(prompt)
    elif isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            budget.add(first)
        elif isinstance(first, int) and not isinstance(first, bool):
            # Token ids: the first ones, as text (bounded like any prefix).
            budget.add(",".join(str(t) for t in prompt[: budget.limit // 4]
                                if isinstance(t, int)))
        elif isinstance(first, list):
            budget.add(",".join(str(t) for t in first[: budget.limit // 4]
                                if isinstance(t, int)))


def reusable_chars(body: Mapping[str, Any]) -> int:
    """Characters of a conversation's text before its last user message: what
    its home replica's prefix cache holds from the earlier turns (their
    prompts and answers), which another replica would prefill again. 0 for a
    prompt (no turns to tell apart). Text parts only, as the key; a length
    per message, so the cost is one pass over the list."""
    return _lengths(body)[1]


def prompt_chars(body: Mapping[str, Any]) -> int:
    """Characters of a request's prompt text (messages, a system field, a
    prompt string or list of strings): what an uncached replica prefills."""
    total = _lengths(body)[0]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        total += len(prompt)
    elif isinstance(prompt, list):
        total += sum(len(p) for p in prompt if isinstance(p, str))
    return total


def _lengths(body: Mapping[str, Any]) -> tuple[int, int]:
    """(all the messages' text, the text before the last user message)."""
    messages = body.get("messages")
    system = body.get("system")  # Anthropic's Messages: the system prompt is a field
    total = before_last_user = len(system) if isinstance(system, str) else 0
    if not isinstance(messages, list):
        return total, 0
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        if message.get("role") == "user":
            before_last_user = total
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, Mapping) and isinstance(part.get("text"), str))
    return total, before_last_user


def home_key(model: str, key: str) -> str:
    """The KV key of a conversation's home: per model, since two models'
    replicas are different machines (KV keys allow the token alphabet)."""
    return f"{encode_token(model)}.{key}"


# --------------------------------------------------------------------------
# The routing decision
# --------------------------------------------------------------------------


class Reason(StrEnum):
    """Why a request went where it went (a metric label and a trace attribute)."""

    HOME = "home"              # the key's home replica, which has room
    NEW_HOME = "new_home"      # no home yet: the replica with the best weighted score
    HOME_WAIT = "home_wait"    # home at its limit, but its slot comes sooner than the prefill saved
    HOME_BUSY = "home_busy"    # home at its limit: shared queue, whoever frees first
    HOME_GONE = "home_gone"    # home no longer alive: chosen anew
    ALL_BUSY = "all_busy"      # no replica has room: shared queue
    NO_KEY = "no_key"          # nothing to route on: shared queue
    OFF = "off"                # affinity off, or a single replica: shared queue


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """What the workers registry says about one replica of a model, summed
    over the workers serving it."""

    name: str
    in_flight: int
    limit: int
    # Backend-reported KV-cache use in [0, 1] and its waiting requests
    # (vLLM's /metrics, llama.cpp's /slots), None where not reported.
    kv_usage: float | None = None
    waiting: int | None = None
    # What the replica's workers measured (None until they have): a job's
    # mean time in a slot, and the time to first token per prompt character
    # of jobs that were not at their home (so mostly uncached: the prefill).
    service_s: float | None = None
    prefill_s_per_char: float | None = None
    # How long the youngest of its running jobs has run (None: none runs).
    youngest_s: float | None = None

    @property
    def free(self) -> int:
        return self.limit - self.in_flight

    def expected_wait(self) -> float | None:
        """Seconds until a job queued here now gets a slot, or None when the
        replica's service time is not known yet. The slots free one every
        ``service_s / limit`` on average, and the job waits for those ahead
        of it (in-flight past the limit, the backend's own waiting) too.
        When even the youngest running job has outlived a mean job, the
        slots are held by long ones, and nothing says when one frees:
        infinite."""
        if self.service_s is None or self.limit <= 0:
            return None
        if self.youngest_s is not None and self.youngest_s > self.service_s:
            return math.inf
        ahead = max(0, self.in_flight - self.limit) + (self.waiting or 0)
        return (ahead + 1) * self.service_s / self.limit

    def worth_waiting(self, reusable: int, max_wait: float) -> bool:
        """A full replica still worth a turn of a conversation it holds
        ``reusable`` characters of: its slot is expected sooner than the
        prefill those characters cost elsewhere, and within ``max_wait``
        (past which the dispatcher copies the job to the shared queue
        anyway). Unknown times: not worth it."""
        if reusable <= 0 or self.prefill_s_per_char is None:
            return False
        wait = self.expected_wait()
        return wait is not None and wait < min(max_wait, reusable * self.prefill_s_per_char)

    @property
    def headroom(self) -> float:
        """In (0, 1] while the replica can take a job, else 0."""
        if self.limit <= 0 or self.free <= 0 or self.waiting:
            return 0.0
        slots = self.free / self.limit
        if self.kv_usage is None:
            return slots
        return slots * max(0.0, min(1.0, 1.0 - self.kv_usage))


@dataclass(frozen=True, slots=True)
class Route:
    """``replica`` None means the model's shared queue."""

    replica: str | None
    reason: Reason


def choose(key: str | None, home: str | None, replicas: Sequence[ReplicaLoad], *,
           reusable: int = 0, max_wait: float = 0.0) -> Route:
    """Where one request goes. Pure: same inputs, same answer, on every
    dispatcher. ``reusable``: the request's characters its home has cached
    (:func:`reusable_chars`); ``max_wait``: the longest a routed job waits
    for its replica before it is copied to the shared queue."""
    if len(replicas) < 2:
        return Route(None, Reason.OFF)
    if key is None:
        return Route(None, Reason.NO_KEY)
    by_name = {r.name: r for r in replicas}
    if home is not None and home in by_name:
        load = by_name[home]
        if load.headroom > 0:
            return Route(home, Reason.HOME)
        if load.worth_waiting(reusable, max_wait):
            # Full, but a slot comes before another replica would have
            # prefilled what the home holds: the turn queues at its home.
            return Route(home, Reason.HOME_WAIT)
        # The home is warm but full, and waiting would cost more than the
        # cache saves. The shared queue lets whichever replica frees first
        # take it (and become its new home).
        return Route(None, Reason.HOME_BUSY)
    best = _rendezvous(key, replicas)
    if best is None:
        return Route(None, Reason.ALL_BUSY)
    return Route(best, Reason.HOME_GONE if home is not None else Reason.NEW_HOME)


def _rendezvous(key: str, replicas: Sequence[ReplicaLoad]) -> str | None:
    """Weighted rendezvous hashing (Schindelhauer and Schomaker's logarithmic
    method): each replica's score is ``-headroom / ln(u)`` with ``u`` a uniform
    hash of (key, replica) in (0, 1). Keys spread in proportion to headroom,
    and a replica joining or leaving moves only the keys it wins or held."""
    best: str | None = None
    best_score = 0.0
    for replica in replicas:
        weight = replica.headroom
        if weight <= 0:
            continue
        digest = hashlib.blake2b(f"{key}\0{replica.name}".encode(), digest_size=8).digest()
        u = (int.from_bytes(digest, "big") + 1) / (2**64 + 2)  # strictly inside (0, 1)
        score = -weight / math.log(u)
        if score > best_score:
            best, best_score = replica.name, score
    return best
