"""Admission policy: the seam where quotas and queue mode plug in.

The dispatcher loop asks an :class:`AdmissionPolicy` about every request and
acts on the :class:`Decision`; it never decides anything itself. Today the only
policy is :class:`AdmitAll`. Token quotas (Redis) and queue-mode degradation
are further implementations of the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from tidegate.protocol import Admission, ErrorInfo, Request


@dataclass(frozen=True, slots=True)
class Decision:
    admission: Admission
    position: int = 0
    error: ErrorInfo | None = None


ADMIT = Decision(Admission.ADMITTED)


class AdmissionPolicy(Protocol):
    async def admit(self, request: Request) -> Decision: ...


class AdmitAll:
    """Admits every request. Quotas arrive with the Redis-backed policy."""

    async def admit(self, request: Request) -> Decision:
        return ADMIT
