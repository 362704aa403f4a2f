"""Quota policies: what they are, which apply to a request, and their KV bucket.

A :class:`Policy` sets limits (requests and tokens per minute, concurrent
streams; 0 = unlimited) for one scope: a tenant, a model, a user of a tenant,
or a combination; an empty field means "any". A request must fit within every
policy whose set fields all match it.

Policies live in ``<P>_POLICIES`` keyed by :attr:`Policy.scope_id`
(``tenant.<t>.model.<m>.user.<u>``, ``=`` for "any"), as JSON;
:class:`PolicySet` is the sans-I/O index dispatchers keep in sync with
:func:`watch_policies`. Docs: docs/keys-and-policies.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker.broker import ensure_bucket
from tidegate.broker.kvwatch import follow_bucket, snapshot
from tidegate.config import Config
from tidegate.errors import ProtocolError
from tidegate.wire.subjects import decode_token, encode_token

log = logging.getLogger("tidegate.policies")

ANY = "="  # scope-id token for "any"; encode_token never produces "="
# The model of batch-only policies: `--model @batch` (with or without a tenant)
# limits only requests of class batch, on top of the policies they share with
# interactive ones (docs/batch.md). No configured model is called that.
BATCH_SCOPE = "@batch"
LIMITS = ("rpm", "tpm", "concurrency")
_FIELDS = ("tenant", "model", "user", *LIMITS)


def _check_scope(tenant: str, model: str, user: str) -> None:
    for name, value in (("tenant", tenant), ("model", model), ("user", user)):
        if not isinstance(value, str):
            raise ValueError(f"policy {name} must be a string, got {value!r}")
    if user and not tenant:
        raise ValueError("a user policy needs its tenant: users belong to a tenant")
    if not tenant and not model:
        raise ValueError("a policy needs a tenant, a model or both")


def scope_id(tenant: str = "", model: str = "", user: str = "") -> str:
    """The KV key of the policy for this scope ("" = any)."""
    _check_scope(tenant, model, user)
    return (f"tenant.{encode_token(tenant) if tenant else ANY}"
            f".model.{encode_token(model) if model else ANY}"
            f".user.{encode_token(user) if user else ANY}")


def parse_scope_id(sid: str) -> tuple[str, str, str]:
    """Invert :func:`scope_id`: ``(tenant, model, user)``. Raises ``ValueError``."""
    parts = sid.split(".")
    if len(parts) != 6 or parts[0::2] != ["tenant", "model", "user"]:
        raise ValueError(f"not a policy scope id: {sid!r}")
    tenant, model, user = ("" if tok == ANY else decode_token(tok) for tok in parts[1::2])
    _check_scope(tenant, model, user)
    return tenant, model, user


@dataclass(frozen=True, slots=True)
class Policy:
    """Limits for one scope. ``""`` = any; a limit of 0 = unlimited."""

    tenant: str = ""
    model: str = ""
    user: str = ""
    rpm: int = 0  # requests per minute
    tpm: int = 0  # tokens (prompt + completion) per minute
    concurrency: int = 0  # streams open at once

    def __post_init__(self) -> None:
        _check_scope(self.tenant, self.model, self.user)
        for name in LIMITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"policy {name} must be an integer >= 0, got {value!r}")

    @property
    def scope(self) -> tuple[str, str, str]:
        return self.tenant, self.model, self.user

    @property
    def scope_id(self) -> str:
        return scope_id(self.tenant, self.model, self.user)

    @property
    def scope_label(self) -> str:
        """Human-readable scope, e.g. ``tenant 'acme' x model 'gpt-4o'``."""
        return " x ".join(f"{name} {value!r}" for name, value in
                          (("tenant", self.tenant), ("model", self.model), ("user", self.user))
                          if value)

    @property
    def has_limits(self) -> bool:
        return bool(self.rpm or self.tpm or self.concurrency)

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    def encode(self) -> bytes:
        return json.dumps(self.as_dict(), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Policy:
        return decode_record(cls, data, _FIELDS, "policy")


class PolicySet:
    """The policies in force, indexed by scope (sans-I/O).

    :meth:`applicable` looks up each scope a request can fall in (at most 5:
    tenant x model x user, tenant x model, tenant x user, tenant, model), so
    its cost does not grow with the number of policies.
    """

    def __init__(self, policies: Iterable[Policy] = ()) -> None:
        self._by_scope: dict[tuple[str, str, str], Policy] = {}
        self._by_id: dict[str, tuple[str, str, str]] = {}
        for policy in policies:
            self.put(policy)

    def __len__(self) -> int:
        return len(self._by_scope)

    def __iter__(self) -> Iterator[Policy]:
        return iter(sorted(self._by_scope.values(), key=lambda p: p.scope))

    def put(self, policy: Policy) -> None:
        """Add the policy, replacing any at the same scope."""
        self._by_scope[policy.scope] = policy
        self._by_id[policy.scope_id] = policy.scope

    def remove(self, sid: str) -> Policy | None:
        """Remove the policy with this scope id; returns it, or None if absent."""
        scope = self._by_id.pop(sid, None)
        return None if scope is None else self._by_scope.pop(scope, None)

    def get(self, tenant: str = "", model: str = "", user: str = "") -> Policy | None:
        return self._by_scope.get((tenant, model, user))

    def applicable(self, tenant: str, model: str, user: str = "",
                   batch: bool = False) -> list[Policy]:
        """Every policy that applies to a request, narrowest scope first;
        ``batch`` adds the batch-only ones (model ``@batch``) of its tenant
        and of everyone."""
        found = []
        for scope in _scopes(tenant, model, user):
            policy = self._by_scope.get(scope)
            if policy is not None:
                found.append(policy)
        if batch:
            for scope in ((tenant, BATCH_SCOPE, ""), ("", BATCH_SCOPE, "")):
                policy = self._by_scope.get(scope)
                if policy is not None:
                    found.append(policy)
        return found


def _scopes(tenant: str, model: str, user: str) -> Iterator[tuple[str, str, str]]:
    """The scopes a request can fall in, narrowest first, each once."""
    if tenant:
        if user:
            if model:
                yield tenant, model, user
            yield tenant, "", user
        if model:
            yield tenant, model, ""
        yield tenant, "", ""
    if model:
        yield "", model, ""


# --------------------------------------------------------------------------
# KV
# --------------------------------------------------------------------------


async def ensure_policies_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    """The ``<P>_POLICIES`` bucket, created when missing. Idempotent."""
    return await ensure_bucket(js, config, config.nats.subjects.policies_bucket,
                               "tidegate: quota policies by scope")


async def set_policy(kv: KeyValue, policy: Policy) -> int:
    """Store the policy, replacing the one at its scope; returns the KV revision."""
    if not policy.has_limits:
        raise ValueError("a policy needs at least one limit (rpm, tpm or concurrency)")
    return int(await kv.put(policy.scope_id, policy.encode()))


async def list_policies(kv: KeyValue) -> list[Policy]:
    """Every stored policy, sorted by scope. Unreadable ones are logged and skipped."""
    policies = []
    for sid, value in (await snapshot(kv)).items():
        try:
            policies.append(_decode_at(sid, value))
        except ProtocolError as exc:
            log.warning("skipping policy %s: %s", sid, exc)
    return sorted(policies, key=lambda p: p.scope)


async def delete_policy(kv: KeyValue, sid: str) -> bool:
    """Delete the policy with this scope id; False if there is none."""
    try:
        await kv.get(sid)
    except nats.js.errors.KeyNotFoundError:
        return False
    await kv.delete(sid)
    return True


async def watch_policies(kv: KeyValue, policies: PolicySet, *,
                         on_synced: Callable[[], None] | None = None) -> None:
    """Keep ``policies`` equal to the bucket: existing policies first, then
    ``on_synced()`` once, then live changes. A value that cannot be read is
    logged and ignored (whatever was in force at that scope stays). Runs until
    cancelled."""

    def put(sid: str, value: bytes) -> None:
        try:
            policy = _decode_at(sid, value)
        except ProtocolError as exc:
            log.error("ignoring policy %s: %s", sid, exc)
            return
        policies.put(policy)

    def delete(sid: str) -> None:
        policies.remove(sid)

    await follow_bucket(kv, put, delete, on_synced=on_synced)


def _decode_at(sid: str, value: bytes) -> Policy:
    policy = Policy.decode(value)
    if policy.scope_id != sid:
        raise ProtocolError(f"policy for {policy.scope_id} stored under {sid}")
    return policy



R = TypeVar("R")


def decode_record(kind: Callable[..., R], data: bytes, fields: Iterable[str], what: str) -> R:
    """``kind(**fields)`` from a KV record's JSON object (policies, budgets):
    a field outside ``fields``, a value ``kind`` refuses (ValueError,
    TypeError) or JSON that is not an object is one :class:`ProtocolError`,
    "malformed <what>: ...", for the watcher to log and skip."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise TypeError("not an object")
        unknown = set(raw) - set(fields)
        if unknown:
            raise ValueError(f"unknown fields {sorted(unknown)}")
        return kind(**raw)
    except (ValueError, TypeError) as exc:
        raise ProtocolError(f"malformed {what}: {exc}") from None
