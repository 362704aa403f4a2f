"""The KV buckets behind routing across replicas (docs/routing.md): conversation
homes (dispatchers read, workers write) and claims (workers only)."""

from __future__ import annotations

from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from tidegate.broker import broker
from tidegate.config import Config


async def ensure_buckets(js: JetStreamContext, config: Config) -> tuple[KeyValue, KeyValue]:
    """The homes bucket (TTL ``routing.home_ttl``) and the claims bucket (TTL
    ``streams.max_age``: a claim must outlive every copy of its job, and no job
    outlives the jobs stream's max age)."""
    subjects = config.nats.subjects
    homes = await broker.ensure_bucket(
        js, config, subjects.affinity_bucket, "tidegate: conversation -> replica homes",
        ttl=config.routing.home_ttl)
    claims = await broker.ensure_bucket(
        js, config, subjects.claims_bucket, "tidegate: which copy of a routed job runs",
        ttl=config.streams.max_age)
    return homes, claims

