"""Dispatcher process: pull requests, decide, publish jobs.

Invariant: a request message is acked only after its job is published (or it
is dropped on purpose: expired, cancelled, malformed). A dispatcher killed at
any point loses nothing: JetStream redelivers the unacked request after
``dispatcher.ack_wait``, and the job publish is deduplicated by ``Nats-Msg-Id``
(the request id) within the jobs stream's duplicate window, so a request
dispatched twice still runs once.

Any number of dispatchers share one durable pull consumer; JetStream spreads
requests between them.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import redis.asyncio as aioredis
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from dispatcher.admission import AdmissionPolicy, AdmitAll
from tidegate import broker
from tidegate.cancels import CancelRegistry
from tidegate.config import Config
from tidegate.errors import ProtocolError
from tidegate.protocol import Admission, Request, Status

log = logging.getLogger("tidegate.dispatcher")


class Dispatcher:
    def __init__(self, config: Config, nc: NATS, js: JetStreamContext,
                 policy: AdmissionPolicy) -> None:
        self.config = config
        self.nc = nc
        self.js = js
        self.policy = policy
        self.subjects = config.nats.subjects
        self.cancels = CancelRegistry(ttl=config.streams.max_age)

    def on_cancel(self, request_id: str, reason: str) -> None:
        self.cancels.add(request_id)

    async def handle_safely(self, msg: Msg) -> None:
        """Handle one request; a failure leaves it unacked, so it is redelivered."""
        try:
            await self.handle(msg)
        except Exception:
            log.exception("dispatching failed; the request will be redelivered")

    async def handle(self, msg: Msg) -> None:
        try:
            request = Request.decode(msg.data)
        except ProtocolError as exc:
            # Redelivering a message nobody can read helps no one.
            log.error("terminating malformed request message: %s", exc)
            await msg.term()
            return
        if request.deadline_ms < time.time() * 1000:
            log.info("dropping request %s: its deadline passed while queued", request.id)
            await msg.ack()
            return
        if request.id in self.cancels:
            log.info("dropping request %s: cancelled by the client", request.id)
            await msg.ack()
            return

        decision = await self.policy.admit(request)
        status = Status(decision.admission, decision.position, decision.error)
        await self.nc.publish(request.reply, status.encode())
        if decision.admission is Admission.REJECTED:
            await msg.ack()
            return
        try:
            await self.js.publish(self.subjects.job(request.model), msg.data,
                                  headers={"Nats-Msg-Id": request.id})
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not publish job for %s (%s); will retry", request.id, exc)
            await msg.nak(delay=1)
            return
        await msg.ack()
        log.debug("dispatched %s to %s", request.id, self.subjects.job(request.model))


async def _check_redis(config: Config) -> None:
    client = aioredis.from_url(config.redis.url, socket_timeout=config.redis.timeout,
                               socket_connect_timeout=config.redis.timeout)
    try:
        await client.ping()
        log.info("redis at %s answers", config.redis.url)
    except Exception as exc:
        # Admission does not use Redis yet; quotas will, with a fail-open or
        # fail-closed policy. Say so loudly but keep dispatching.
        log.warning("redis at %s does not answer (%s)", config.redis.url, exc)
    finally:
        await client.aclose()


async def serve(config: Config, stop: asyncio.Event) -> None:
    cfg = config.dispatcher
    subjects = config.nats.subjects
    nc = await broker.connect(config.nats, "tidegate-dispatcher", stop)
    js = broker.jetstream(nc, config.nats)
    await broker.ensure_streams(js, config)
    await _check_redis(config)
    await broker.ensure_consumer(
        js, subjects.requests_stream, subjects.dispatcher_consumer, subjects.requests_wildcard,
        ack_wait=cfg.ack_wait, max_deliver=-1, max_ack_pending=max(1000, cfg.batch * 16))
    psub = await js.pull_subscribe_bind(durable=subjects.dispatcher_consumer,
                                        stream=subjects.requests_stream)
    dispatcher = Dispatcher(config, nc, js, AdmitAll())
    cancels = await broker.ensure_cancels_bucket(js, config)
    log.info("dispatcher pulling from %s", subjects.requests_stream)

    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(broker.watch_cancels(cancels, dispatcher.on_cancel))
            while not stop.is_set():
                try:
                    msgs = await psub.fetch(cfg.batch, timeout=cfg.fetch_timeout)
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except nats.errors.Error as exc:
                    log.warning("fetch failed: %s", exc)
                    await asyncio.sleep(0.5)
                    continue
                async with asyncio.TaskGroup() as batch:
                    for msg in msgs:
                        batch.create_task(dispatcher.handle_safely(msg))
            watcher.cancel()
    finally:
        await broker.close(nc)
        log.info("dispatcher stopped")
