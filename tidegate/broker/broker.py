"""NATS connection and JetStream provisioning shared by every tier.

Who creates streams, consumers and buckets depends on the login
(docs/security.md). With per-tier credentials (``nats.credentials``) only the
admin identity may: ``tidegate setup`` (tidegate.control.provision) creates or
updates everything before the tiers start, and a tier only *binds* to what
exists, waiting up to ``_SETUP_PATIENCE`` for a setup still running. Without
credentials (the dev path) or as admin, every ``ensure_*`` here creates what is
missing and updates what changed, idempotently, so every tier can be started
alone and in any order.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from tidegate.broker.auth import connect_options, credentials_path
from tidegate.broker.kvwatch import follow_bucket, wait_synced
from tidegate.broker.permissions import role_of
from tidegate.config import Config, NatsConfig
from tidegate.errors import BrokerError
from tidegate.wire import streamlog

log = logging.getLogger("tidegate.broker")

# Seconds between two "cannot reach NATS" lines while a tier waits for NATS at start.
STILL_WAITING = 30.0


async def connect(cfg: NatsConfig, name: str, stop: asyncio.Event | None = None,
                  on_link: Callable[[bool], None] | None = None) -> NATS:
    """Connect to NATS, retrying until it answers or ``stop`` is set.

    Once connected the client reconnects forever on its own: a NATS restart
    must never need a tidegate restart. A link cut silently (a partition: no
    FIN, no RST) is noticed by the client's own PINGs: ``nats.max_pings_out``
    unanswered, ``nats.ping_interval`` apart, and it drops the connection and
    reconnects. ``on_link(False)`` is called at every disconnect,
    ``on_link(True)`` at every reconnect (workers.fencing).
    """

    client: list[NATS] = []  # filled once connected; a closed client's disconnect is expected
    quiet_until = 0.0

    async def on_error(exc: Exception) -> None:
        nonlocal quiet_until
        if client:
            log.warning("nats error (%s): %s", name, exc)
            return
        # Not connected yet: nats-py retries the first connection itself,
        # every reconnect_time_wait, reporting each failure here; one line
        # per STILL_WAITING seconds says it all.
        now = asyncio.get_running_loop().time()
        if now >= quiet_until:
            quiet_until = now + STILL_WAITING
            log.warning("cannot reach NATS at %s (%s: %s); waiting for it (%s)",
                        cfg.url, type(exc).__name__, exc, name)

    async def on_disconnect() -> None:
        if not (client and client[0].is_closed):
            log.warning("nats disconnected (%s)", name)
            if on_link is not None:
                on_link(False)

    async def on_reconnect() -> None:
        log.info("nats reconnected (%s)", name)
        if on_link is not None:
            on_link(True)

    servers = [s.strip() for s in cfg.url.split(",") if s.strip()]
    login = connect_options(cfg, name)  # a bad credentials file fails here, once
    delay = 0.2
    while True:
        try:
            attempt = asyncio.ensure_future(nats.connect(
                servers=servers,
                name=name,
                **login,
                connect_timeout=max(1, int(cfg.connect_timeout)),
                allow_reconnect=True,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                # nats-py sleeps on it: a float works, its annotation says int.
                ping_interval=cast(int, cfg.ping_interval),
                max_outstanding_pings=cfg.max_pings_out,
                error_cb=on_error,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                # Subjects are built by tidegate.subjects, never from user input
                # directly, so per-publish validation would only cost time.
                skip_subject_validation=True,
            ))
            try:
                if stop is not None:
                    # nats-py's first connection never gives up (max_reconnect_attempts
                    # is -1), so only stop ends the wait: SIGTERM must work here.
                    stopping = asyncio.ensure_future(stop.wait())
                    await asyncio.wait((attempt, stopping),
                                       return_when=asyncio.FIRST_COMPLETED)
                    stopping.cancel()
                    if not attempt.done():
                        raise BrokerError(f"stopped before NATS at {cfg.url} answered")
                nc = await attempt
            finally:
                if not attempt.done():  # stopped, or this task cancelled
                    attempt.cancel()
                    await asyncio.gather(attempt, return_exceptions=True)
            client.append(nc)
            return nc
        except BrokerError:
            raise
        except Exception as exc:
            if stop is not None and stop.is_set():
                raise BrokerError(f"stopped before NATS at {cfg.url} answered") from exc
            log.warning("cannot reach NATS at %s (%s); retrying in %.1fs", cfg.url, exc, delay)
            if stop is not None:
                try:
                    await asyncio.wait_for(stop.wait(), delay)
                except TimeoutError:
                    pass
            else:
                await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def close(nc: NATS) -> None:
    """Flush what is queued (acks, final messages), then close.

    Not ``drain()``: every tier has already stopped its consumers and finished
    (or handed back) its work by the time it closes, and draining pull
    subscriptions can stall for the whole drain timeout.
    """
    try:
        await nc.flush(timeout=2)
    except Exception as exc:
        log.warning("nats flush on close failed: %s", exc)
    await nc.close()


class NotProvisioned(BrokerError):
    """A stream, consumer or bucket is missing and this login may not create it."""


class TierJetStream(JetStreamContext):
    """A JetStream context that knows whether its login may create and update
    streams, consumers and buckets (:func:`may_provision`)."""

    def __init__(self, nc: NATS, timeout: float, provision: bool) -> None:
        super().__init__(nc, timeout=timeout)
        self.provision = provision


def may_provision(cfg: NatsConfig, client_name: str) -> bool:
    """True for admin (``tidegate setup``, the CLI) and for a tier without
    credentials (a server without authorization lets anyone create)."""
    role = role_of(client_name)
    return role == "admin" or credentials_path(cfg, role) is None


def provisions(js: JetStreamContext) -> bool:
    """Whether ``js`` may create and update (any context not made by
    :func:`jetstream`, e.g. the admin CLI's, may)."""
    return not isinstance(js, TierJetStream) or js.provision


def jetstream(nc: NATS, cfg: NatsConfig) -> JetStreamContext:
    name = str(nc.options.get("name") or "")
    return TierJetStream(nc, cfg.request_timeout, may_provision(cfg, name))


def _missing(what: str) -> NotProvisioned:
    return NotProvisioned(f"{what} does not exist, and this tier's NATS credentials may not "
                          f"create it: run `tidegate setup` (admin credentials) first")


def _stream_configs(config: Config) -> list[StreamConfig]:
    s = config.streams
    subjects = config.nats.subjects
    storage = StorageType.FILE if s.storage == "file" else StorageType.MEMORY
    common: dict[str, Any] = dict(
        retention=RetentionPolicy.WORK_QUEUE,
        storage=storage,
        num_replicas=s.replicas,
        # Discard new: a full stream refuses the publish, and the edge answers
        # 503 + Retry-After. Dropping old requests instead would lose accepted work.
        discard=DiscardPolicy.NEW,
        duplicate_window=s.duplicate_window,
        max_age=s.max_age,
    )
    return [
        StreamConfig(
            name=subjects.requests_stream,
            description="tidegate: client requests, edge -> dispatcher",
            subjects=[subjects.requests_wildcard],
            max_msgs=s.requests_max_msgs,
            max_bytes=s.requests_max_bytes,
            **common,
        ),
        StreamConfig(
            name=subjects.jobs_stream,
            description="tidegate: admitted jobs, dispatcher -> workers",
            subjects=[subjects.jobs_wildcard],
            max_msgs=s.jobs_max_msgs,
            max_bytes=s.jobs_max_bytes,
            **common,
        ),
        # Usage is a log, not a queue: the dispatchers' reconciler consumes it,
        # and billing or analytics can add their own consumers; it ages out.
        StreamConfig(
            name=subjects.usage_stream,
            description="tidegate: actual usage per request, workers -> dispatchers",
            subjects=[subjects.usage_wildcard],
            retention=RetentionPolicy.LIMITS,
            storage=storage,
            num_replicas=s.replicas,
            discard=DiscardPolicy.OLD,
            duplicate_window=s.duplicate_window,
            max_age=s.usage_max_age,
            max_bytes=s.usage_max_bytes,
        ),
        # Resumable streams' logs (tidegate.wire.streamlog): kept for
        # resume.retention, the oldest dropped first when the whole log is full.
        StreamConfig(
            name=streamlog.stream_name(subjects),
            description="tidegate: resumable streams' output, workers -> any edge",
            subjects=[streamlog.wildcard(subjects)],
            retention=RetentionPolicy.LIMITS,
            storage=storage,
            num_replicas=s.replicas,
            discard=DiscardPolicy.OLD,
            max_age=config.resume.retention,
            max_bytes=config.resume.max_bytes,
            allow_direct=True,
        ),
    ]


# JetStream API errors that mean "not now": a cluster electing its meta or
# stream leader (a node just restarted, or every tier creating R3 streams at
# once) answers late or with 503 for a few seconds.
_TRANSIENT = (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError)
_SETUP_PATIENCE = 30.0  # seconds a tier keeps retrying stream setup at start
T = TypeVar("T")


async def ensure_streams(js: JetStreamContext, config: Config) -> None:
    """Create or update ``<P>_REQUESTS``, ``<P>_JOBS`` and ``<P>_USAGE``. Idempotent.

    Transient JetStream errors are retried for ``_SETUP_PATIENCE`` seconds, so
    tiers starting together against a forming cluster do not exit."""
    deadline = asyncio.get_running_loop().time() + _SETUP_PATIENCE
    for sc in _stream_configs(config):
        while True:
            try:
                await _ensure_stream(js, sc)
                break
            except BrokerError as exc:
                waiting = isinstance(exc, NotProvisioned) or isinstance(exc.__cause__, _TRANSIENT)
                if not waiting or asyncio.get_running_loop().time() >= deadline:
                    raise
                log.warning("%s; retrying", exc)
                await asyncio.sleep(0.5)


async def _ensure_stream(js: JetStreamContext, sc: StreamConfig) -> None:
    """Create ``sc``, or update it if it exists; every failure is a BrokerError."""
    try:
        await js.stream_info(sc.name)  # type: ignore[arg-type]
    except NotFoundError:
        if not provisions(js):
            raise _missing(f"stream {sc.name}") from None
        try:
            await js.add_stream(sc)
            log.info("created stream %s", sc.name)
            return
        except nats.js.errors.BadRequestError:
            pass  # another tier created it concurrently: fall through to update
        except Exception as exc:
            raise BrokerError(f"cannot create stream {sc.name}: {exc}") from exc
    except Exception as exc:
        raise BrokerError(f"cannot read stream {sc.name}: {exc}") from exc
    if not provisions(js):
        return  # bound: its config is setup's business
    try:
        await js.update_stream(sc)
    except Exception as exc:
        raise BrokerError(f"cannot update stream {sc.name}: {exc}") from exc


# What a bucket or object-store setup retries: timeouts, and (for a tier that
# only binds) a bucket setup has not made yet. Not a 503: that is also what a
# server without JetStream answers, and the admin CLI must say so at once
# (tests/test_cli_admin.py), not after the patience runs out.
_BUCKET_TRANSIENT: tuple[type[Exception], ...] = (nats.errors.TimeoutError, NotProvisioned)
# nats-server's JSClusterNotAvailErr, "JetStream system temporarily
# unavailable": the node the client is on reaches no meta leader (an
# election, or the node cut from its peers). Always retried: a dispatcher and
# a worker starting while a partition cut their node exited on it. A server
# without JetStream answers without this code (no responders), at once.
JS_CLUSTER_NOT_AVAILABLE = 10008


def _not_now(exc: Exception, transient: tuple[type[Exception], ...]) -> bool:
    return isinstance(exc, transient) or (
        isinstance(exc, nats.js.errors.ServiceUnavailableError)
        and exc.err_code == JS_CLUSTER_NOT_AVAILABLE)


async def patiently(make: Callable[[], Awaitable[T]], what: str,
                    transient: tuple[type[Exception], ...] = _BUCKET_TRANSIENT) -> T:
    """``await make()``, retrying ``transient`` JetStream errors (a cluster
    that is forming or electing a leader answers late) and a cluster without
    a reachable meta leader (:data:`JS_CLUSTER_NOT_AVAILABLE`) for
    ``_SETUP_PATIENCE`` seconds. For the setup a tier does at start: without
    it, one election or partition kills the process."""
    deadline = asyncio.get_running_loop().time() + _SETUP_PATIENCE
    while True:
        try:
            return await make()
        except Exception as exc:
            if not _not_now(exc, transient) or asyncio.get_running_loop().time() >= deadline:
                raise
            log.warning("%s: %s; retrying", what, type(exc).__name__)
            await asyncio.sleep(0.5)


async def ensure_bucket(js: JetStreamContext, config: Config, bucket: str, description: str,
                        ttl: float | None = None) -> KeyValue:
    """A KV bucket with one value per key, created when missing (with the
    streams' storage and replicas). Idempotent, safe when several processes
    start at once, and patient with a forming cluster."""
    return await patiently(lambda: _ensure_bucket(js, config, bucket, description, ttl),
                           f"KV bucket {bucket}")


async def _ensure_bucket(js: JetStreamContext, config: Config, bucket: str, description: str,
                         ttl: float | None) -> KeyValue:
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        if not provisions(js):
            raise _missing(f"KV bucket {bucket}") from None
    storage = StorageType.FILE if config.streams.storage == "file" else StorageType.MEMORY
    try:
        return await js.create_key_value(KeyValueConfig(
            bucket=bucket, description=description, history=1, ttl=ttl, storage=storage,
            replicas=config.streams.replicas))
    except nats.js.errors.BadRequestError:
        return await js.key_value(bucket)  # created concurrently by another process


async def ensure_cancels_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    """The KV bucket of cancel tombstones; entries expire after streams.max_age,
    by which time no stream holds the request any more."""
    return await ensure_bucket(js, config, config.nats.subjects.cancels_bucket,
                               "tidegate: cancelled request ids", ttl=config.streams.max_age)


async def ensure_owners_bucket(js: JetStreamContext, config: Config) -> KeyValue:
    """The KV bucket of Responses API response owners (workers.owners);
    entries expire after streams.responses_max_age."""
    return await ensure_bucket(js, config, config.nats.subjects.responses_bucket,
                               "tidegate: response id -> tenant",
                               ttl=config.streams.responses_max_age)


async def watch_cancels(kv: KeyValue, on_cancel: Callable[[str, str], None], *,
                        on_synced: Callable[[], None] | None = None) -> None:
    """Call ``on_cancel(request_id, reason)`` for every tombstone, existing ones
    first (a tier that starts late still learns of earlier cancels), then
    ``on_synced()`` once. Survives NATS restarts (see tidegate.kvwatch). Runs
    until cancelled."""

    def put(key: str, value: bytes) -> None:
        on_cancel(key, value.decode(errors="replace"))

    # Tombstones expire by the bucket's TTL: nothing to do, or to remember, on a delete.
    await follow_bucket(kv, put, None, on_synced=on_synced)


async def follow_cancels(tg: asyncio.TaskGroup, kv: KeyValue,
                         on_cancel: Callable[[str, str], None], limit: float,
                         tier: str) -> asyncio.Task[None]:
    """Start :func:`watch_cancels` in ``tg`` and return its task once the
    existing tombstones are replayed (or after ``limit`` seconds). A tier must
    not pull work before that: a request cancelled while nobody was pulling
    would otherwise run anyway."""
    synced = asyncio.Event()
    task = tg.create_task(watch_cancels(kv, on_cancel, on_synced=synced.set))
    await wait_synced(synced, limit, f"{tier}: existing cancels")
    return task


async def streams_exist(js: JetStreamContext, config: Config) -> bool:
    subjects = config.nats.subjects
    try:
        for name in (subjects.requests_stream, subjects.jobs_stream):
            await js.stream_info(name)
    except Exception:
        return False
    return True


async def ensure_consumer(
    js: JetStreamContext,
    stream: str,
    durable: str,
    filter_subject: str,
    *,
    ack_wait: float,
    max_deliver: int,
    max_ack_pending: int,
) -> None:
    """Create or update a durable pull consumer. Idempotent. A tier that may
    not provision checks that it exists (waiting for setup) instead."""
    if not provisions(js):
        await patiently(lambda: _bind_consumer(js, stream, durable),
                        f"consumer {durable} on {stream}")
        return
    cc = ConsumerConfig(
        durable_name=durable,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait,
        max_deliver=max_deliver,
        filter_subject=filter_subject,
        max_ack_pending=max_ack_pending,
        max_waiting=4096,
    )
    try:
        # nats-server >= 2.10 treats this as create-or-update for a durable,
        # so a retry is safe: a NATS node dying while a tier starts (an
        # election: late answers) must not kill the tier.
        await patiently(lambda: js.add_consumer(stream, cc), f"consumer {durable} on {stream}")
    except nats.js.errors.BadRequestError as exc:
        # A change the server cannot apply in place (e.g. another filter):
        # keep serving from the existing consumer, loudly.
        log.warning("consumer %s on %s kept its old config: %s", durable, stream, exc)


async def _bind_consumer(js: JetStreamContext, stream: str, durable: str) -> None:
    try:
        await js.consumer_info(stream, durable)
    except NotFoundError:
        raise _missing(f"consumer {durable} on stream {stream}") from None
