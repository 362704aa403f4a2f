"""``tidegate setup``: create or update every stream, consumer and bucket, as admin.

With per-tier NATS credentials no running tier may create, update or delete
a stream, consumer or KV bucket (tidegate.broker.permissions): a tier whose
credentials leak must not be able to mirror the keys, add a source to the
jobs stream or shrink the usage log. So one admin step does all of it before
the tiers start: ``tidegate up`` runs it after starting (and after
restarting) its NATS server, a deployment runs ``tidegate setup`` (a
Kubernetes Job, a compose one-shot) with the admin credentials. It is
idempotent: run it again after changing the config (new models, limits).

The consumer specs live here, once: the tiers call :func:`dispatcher_consumers`
and :func:`worker_consumer` too, which create them on the no-auth dev path and
only check that they exist (waiting for setup) with restricted credentials.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext

from tidegate.broker import bodies, broker
from tidegate.config import Config, ModelConfig
from tidegate.control import (
    admin,
    affinity,
    batches,
    budgets,
    edges_registry,
    keys,
    policies,
    prices,
    tenants,
    workers_registry,
)

log = logging.getLogger("tidegate.setup")

RECONCILERS = "reconcilers"


async def dispatcher_consumers(js: JetStreamContext, config: Config) -> None:
    """The dispatchers' durable consumers: requests and usage."""
    cfg, subjects = config.dispatcher, config.nats.subjects
    await broker.ensure_consumer(
        js, subjects.requests_stream, subjects.dispatcher_consumer, subjects.requests_wildcard,
        # Requests waiting in a queue-mode queue stay unacked (held by their
        # dispatcher), so the consumer must allow all of them on top of the
        # ones being dispatched, or queueing models would stall every model.
        ack_wait=cfg.ack_wait, max_deliver=-1,
        max_ack_pending=max(1000, cfg.batch * 16) + sum(
            m.queue.max_queued for m in config.models if m.queue.ttft_p99 > 0))
    await broker.ensure_consumer(
        js, subjects.usage_stream, RECONCILERS, subjects.usage_wildcard,
        ack_wait=cfg.ack_wait, max_deliver=-1, max_ack_pending=10_000)


async def worker_consumer(js: JetStreamContext, config: Config, model: ModelConfig,
                          replica: str | None = None) -> str:
    """A model's shared job consumer, or (``replica``) one replica's own
    routed queue; returns its durable name."""
    subjects, cfg = config.nats.subjects, config.worker
    if replica is None:
        durable, subject = subjects.worker_consumer(model.name), subjects.job(model.name)
    else:
        durable = subjects.replica_consumer(model.name, replica)
        subject = subjects.job_replica(model.name, replica)
    await broker.ensure_consumer(
        js, subjects.jobs_stream, durable, subject, ack_wait=cfg.ack_wait,
        max_deliver=cfg.max_deliver, max_ack_pending=max(10_000, model.streams_ceiling * 64))
    return durable


def routed(config: Config, model: ModelConfig) -> bool:
    """Whether a model's replicas each get their own queue (docs/routing.md)."""
    return len(model.replicas) > 1 and config.routing.affinity == "auto"


async def provision(js: JetStreamContext, config: Config) -> list[str]:
    """Create or update everything the tiers use; returns what was ensured,
    for the setup command's output. Needs admin rights (or a server without
    authorization)."""
    done: list[str] = []
    subjects = config.nats.subjects
    await broker.ensure_streams(js, config)
    done += ["streams"]
    await dispatcher_consumers(js, config)
    for model in config.models:
        await worker_consumer(js, config, model)
        if routed(config, model):
            for replica in model.replica_names:
                await worker_consumer(js, config, model, replica)
    done += ["consumers"]
    await keys.ensure_keys_bucket(js, config)
    await keys.ensure_last_used_bucket(js, config)
    await policies.ensure_policies_bucket(js, config)
    await tenants.ensure_tenants_bucket(js, config)
    await prices.ensure_prices_bucket(js, config)
    await budgets.ensure_budgets_bucket(js, config)
    await broker.ensure_cancels_bucket(js, config)
    await broker.ensure_owners_bucket(js, config)
    await edges_registry.ensure_bucket(js, config)
    await workers_registry.ensure_bucket(js, config)
    await affinity.ensure_buckets(js, config)
    await batches.open_stores(js, config)
    await bodies.ensure(js, config)
    done += ["KV buckets", "object store"]
    log.info("setup done for prefix %s: %s", subjects.prefix, ", ".join(done))
    return done


def setup(config: Config) -> list[str]:
    """``tidegate setup``: every stream, consumer and bucket, as admin, over
    one short-lived connection (tidegate.control.admin's contract). Patient
    with a forming cluster: up to a minute plus the request timeouts."""

    async def work(js: JetStreamContext) -> list[str]:
        return await provision(js, config)

    return admin.run(config, work, deadline=60 + config.nats.request_timeout * 4)
