"""``tidegate keys`` and ``tidegate policy``: API keys and quota policies in NATS KV.

Each command connects once with a short timeout (unlike the tiers, which wait
for NATS forever), creates the bucket it needs when missing, does its work and
disconnects. Output is a plain table, or JSON with ``--json``. Errors follow
the CLI contract: bad input raises :class:`UsageError` (exit 2), an
unreachable NATS a :class:`~tidegate.errors.BrokerError` and a missing key or
policy :class:`NotFound` (exit 1); none prints a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from tidegate.broker.auth import connect_options
from tidegate.config import Config, NatsConfig
from tidegate.control import keys as tgkeys
from tidegate.control import policies as tgpolicies
from tidegate.errors import BrokerError, ConfigError, TidegateError

log = logging.getLogger("tidegate.admin")

T = TypeVar("T")


class UsageError(ConfigError):
    """The command line asks for something invalid; the CLI exits 2."""


class NotFound(TidegateError):
    """The key or policy named on the command line does not exist."""


# --------------------------------------------------------------------------
# Connecting
# --------------------------------------------------------------------------


async def connect_once(cfg: NatsConfig, name: str) -> NATS:
    """Connect to NATS or raise :class:`BrokerError` within ``cfg.connect_timeout``.

    No retries and no reconnects: a command line tool should say at once that
    NATS is not there, not wait for it the way a service does.
    """
    errors: list[BaseException] = []

    async def on_error(exc: Exception) -> None:
        errors.append(exc)  # reported in the BrokerError below, not as a logged traceback

    servers = [s.strip() for s in cfg.url.split(",") if s.strip()]
    try:
        async with asyncio.timeout(cfg.connect_timeout + 1):
            return await nats.connect(servers=servers, name=name,
                                      **connect_options(cfg, name),
                                      connect_timeout=cfg.connect_timeout,
                                      allow_reconnect=False,
                                      # nats-py reads 0 as "forever"; 1 = two tries each.
                                      max_reconnect_attempts=1, reconnect_time_wait=0.2,
                                      error_cb=on_error)
    except Exception as exc:
        cause = errors[-1] if errors else exc
        reason = (f"no answer within {cfg.connect_timeout:g}s"
                  if isinstance(cause, TimeoutError | nats.errors.TimeoutError)
                  else _describe(cause))
        raise BrokerError(f"cannot reach NATS at {cfg.url}: {reason}") from None


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def run(config: Config, work: Callable[[JetStreamContext], Awaitable[T]]) -> T:
    """Connect, run ``work(js)`` within a deadline, disconnect."""

    async def main() -> T:
        nc = await connect_once(config.nats, "tidegate-admin")
        try:
            js = nc.jetstream(timeout=config.nats.request_timeout)
            deadline = config.nats.request_timeout * 4
            try:
                async with asyncio.timeout(deadline):
                    return await work(js)
            except TimeoutError:
                raise BrokerError(f"NATS at {config.nats.url} did not answer within "
                                  f"{deadline:.0f}s") from None
            except (nats.js.errors.ServiceUnavailableError,
                    nats.errors.NoRespondersError):
                raise BrokerError(f"JetStream is not enabled on the NATS server at "
                                  f"{config.nats.url} (start nats-server with -js)") from None
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                raise BrokerError(f"NATS at {config.nats.url} refused: "
                                  f"{_describe(exc)}") from None
        finally:
            try:
                await nc.close()
            except Exception as exc:  # closing a broken connection tells nothing new
                log.debug("closing NATS: %s", exc)

    return asyncio.run(main())


# --------------------------------------------------------------------------
# Input checks (shared by the argparse types and the commands)
# --------------------------------------------------------------------------


def canonical_model(config: Config, name: str) -> str:
    """The configured model's name for a name or alias; unknown names stay as
    given (the deployment may configure models this config does not know)."""
    model = config.model_index().get(name)
    if model is None:
        print(f"tidegate: note: model {name!r} is not in this config's models; "
              "stored as given", file=sys.stderr)
        return name
    return model.name


def parse_models(value: str) -> tuple[str, ...]:
    """``"a,b"`` -> ``("a", "b")``; empty names are an error."""
    names = tuple(part.strip() for part in value.split(","))
    if not value.strip() or any(not n for n in names):
        raise UsageError(f"--models: expected comma-separated model names, got {value!r}")
    return names


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------


def parse_duration(value: str) -> float:
    """``"90s"``, ``"15m"``, ``"1h"``, ``"30d"``, ``"1h30m"`` or plain seconds -> seconds."""
    text = value.strip().lower()
    if not text:
        raise UsageError("expected a duration such as 90s, 15m, 1h or 30d")
    try:
        return float(text)
    except ValueError:
        pass
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    total, number = 0.0, ""
    for char in text:
        if char.isdigit() or char == ".":
            number += char
        elif char in units and number:
            total += float(number) * units[char]
            number = ""
        else:
            raise UsageError(f"expected a duration such as 90s, 15m, 1h or 30d, got {value!r}")
    if number:
        raise UsageError(f"a duration needs a unit (s, m, h, d, w), got {value!r}")
    return total


def keys_create(config: Config, tenant: str, user: str = "", models: Sequence[str] = (),
                as_json: bool = False, expires_in: float = 0.0) -> int:
    models = tuple(dict.fromkeys(canonical_model(config, m) for m in models))

    async def work(js: JetStreamContext) -> tuple[str, tgkeys.KeyRecord]:
        kv = await tgkeys.ensure_keys_bucket(js, config)
        return await tgkeys.create_key(kv, tenant, user, models, expires_in=expires_in)

    try:
        tgkeys.KeyRecord(key_id="", tenant=tenant, user=user, models=models)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    key, record = run(config, work)
    if as_json:
        print(json.dumps({"key": key, **record.as_dict()}))
    else:
        print(f"key:     {key}")
        print(f"key_id:  {record.key_id}")
        print(f"tenant:  {record.tenant}")
        print(f"user:    {record.user or '-'}")
        print(f"models:  {','.join(record.models) or 'all'}")
        print(f"expires: {_timestamp(record.expires) if record.expires else 'never'}")
    print("Store the key now: it is not shown again (tidegate keeps only its SHA-256 "
          "digest).", file=sys.stderr)
    return 0


def keys_list(config: Config, as_json: bool = False) -> int:
    async def work(js: JetStreamContext) -> tuple[list[tgkeys.KeyRecord], dict[str, float]]:
        records = await tgkeys.list_keys(await tgkeys.ensure_keys_bucket(js, config))
        used = await tgkeys.read_last_used(await tgkeys.ensure_last_used_bucket(js, config))
        return records, {digest[:tgkeys.KEY_ID_LENGTH]: when for digest, when in used.items()}

    records, last_used = run(config, work)
    if as_json:
        print(json.dumps([{**r.as_dict(), "last_used": last_used.get(r.key_id, 0.0)}
                          for r in records]))
        return 0
    if not records:
        print(f"no API keys in {config.nats.subjects.keys_bucket}")
        return 0
    now = time.time()
    _table(["KEY_ID", "TENANT", "USER", "MODELS", "CREATED", "EXPIRES", "LAST_USED"],
           [[r.key_id, r.tenant, r.user or "-", ",".join(r.models) or "all",
             _timestamp(r.created),
             ("expired " if r.expired(now) else "") + _timestamp(r.expires)
             if r.expires else "never",
             _timestamp(last_used[r.key_id]) if r.key_id in last_used else "never"]
            for r in records])
    return 0


def keys_rotate(config: Config, key_id: str, overlap: float, expires_in: float = 0.0,
                as_json: bool = False) -> int:
    """A new key for the same tenant, user and models; the old one expires
    after ``overlap`` seconds."""
    async def work(js: JetStreamContext) -> Any:
        kv = await tgkeys.ensure_keys_bucket(js, config)
        return await tgkeys.rotate_key(kv, key_id, overlap, expires_in=expires_in)

    try:
        result = run(config, work)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if result is None:
        raise NotFound(f"no API key with id {key_id} (see `tidegate keys list`)")
    key, new, old = result
    if as_json:
        print(json.dumps({"key": key, **new.as_dict(), "replaces": old.as_dict()}))
    else:
        print(f"key:     {key}")
        print(f"key_id:  {new.key_id}")
        print(f"tenant:  {new.tenant}")
        print(f"replaces {old.key_id}, which stops working at {_timestamp(old.expires)}")
    print("Store the key now: it is not shown again.", file=sys.stderr)
    return 0


def keys_revoke(config: Config, key_id: str) -> int:
    async def work(js: JetStreamContext) -> bool:
        return await tgkeys.revoke_key(await tgkeys.ensure_keys_bucket(js, config), key_id)

    try:
        found = run(config, work)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not found:
        raise NotFound(f"no API key with id {key_id} (see `tidegate keys list`)")
    print(f"revoked key {key_id}")
    return 0


# --------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------


def policy_set(config: Config, tenant: str = "", model: str = "", user: str = "",
               rpm: int | None = None, tpm: int | None = None,
               concurrency: int | None = None) -> int:
    if rpm is None and tpm is None and concurrency is None:
        raise UsageError("policy set: give at least one limit: --rpm, --tpm or --concurrency")
    try:
        policy = tgpolicies.Policy(
            tenant=tenant, model=canonical_model(config, model) if model else "", user=user,
            rpm=rpm or 0, tpm=tpm or 0, concurrency=concurrency or 0)
    except ValueError as exc:
        raise UsageError(f"policy set: {exc}") from None
    if not policy.has_limits:
        raise UsageError("policy set: every limit given is 0 (unlimited); to remove the "
                         "policy use `tidegate policy delete`")

    async def work(js: JetStreamContext) -> int:
        kv = await tgpolicies.ensure_policies_bucket(js, config)
        return await tgpolicies.set_policy(kv, policy)

    run(config, work)
    print(f"set policy for {policy.scope_label}: {_limits(policy)}")
    return 0


def policy_list(config: Config, as_json: bool = False) -> int:
    async def work(js: JetStreamContext) -> list[tgpolicies.Policy]:
        return await tgpolicies.list_policies(
            await tgpolicies.ensure_policies_bucket(js, config))

    policies = run(config, work)
    if as_json:
        print(json.dumps([p.as_dict() for p in policies]))
        return 0
    if not policies:
        print(f"no policies in {config.nats.subjects.policies_bucket}")
        return 0
    _table(["TENANT", "MODEL", "USER", "RPM", "TPM", "CONCURRENCY"],
           [[p.tenant or "*", p.model or "*", p.user or "*", *(_limit(v) for v in
             (p.rpm, p.tpm, p.concurrency))] for p in policies])
    return 0


def policy_delete(config: Config, tenant: str = "", model: str = "", user: str = "") -> int:
    try:
        probe = tgpolicies.Policy(tenant=tenant, user=user,
                                  model=canonical_model(config, model) if model else "")
    except ValueError as exc:
        raise UsageError(f"policy delete: {exc}") from None

    async def work(js: JetStreamContext) -> bool:
        kv = await tgpolicies.ensure_policies_bucket(js, config)
        return await tgpolicies.delete_policy(kv, probe.scope_id)

    if not run(config, work):
        raise NotFound(f"no policy for {probe.scope_label} (see `tidegate policy list`)")
    print(f"deleted policy for {probe.scope_label}")
    return 0


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _limit(value: int) -> str:
    return str(value) if value else "-"


def _limits(policy: tgpolicies.Policy) -> str:
    return ", ".join(f"{name} {getattr(policy, name) or 'unlimited'}"
                     for name in tgpolicies.LIMITS)


def _timestamp(created: float) -> str:
    return datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _table(header: list[str], rows: list[list[Any]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True))
              .rstrip())
