"""The gRPC ingress (``edge.grpc_port``; protocol: docs/grpc.md).

grpcio's asyncio server in the edge process, on the same loop and
:class:`edge.state.EdgeState` as the HTTP routes: each generation is an ordinary
request (``edge.grpc_calls.run_generation``). Serves ``Gateway/Generate`` (here),
``Gateway/Session`` (``edge.grpc_session``), ``grpc.health.v1.Health`` (SERVING
while ``/readyz`` would be 200) and reflection.

The client's deadline caps the request's; its passing or a client cancel
cancels the work upstream, as an SSE disconnect does. Drain
(:meth:`GrpcIngress.drain`): health NOT_SERVING, new calls refused, resumable
generations get ``Reconnect``, the rest run on for ``edge.shutdown_timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1.health import SERVICE_NAME as HEALTH_SERVICE
from grpc_health.v1.health import aio as health_aio
from grpc_health.v1.health_pb2_grpc import add_HealthServicer_to_server
from grpc_reflection.v1alpha import reflection

from edge import instrument
from edge.grpc_calls import (
    CallSink,
    Generation,
    SlowWriters,
    api_of,
    authenticate,
    error_details,
    error_trailers,
    lenient,
    metadata_of,
    run_generation,
    status_of,
    undecodable,
)
from edge.grpc_session import SessionCall, run_session
from edge.listen import cannot_listen, ensure_free
from edge.state import EdgeState
from tidegate.apis.chat import DIALECT as CHAT
from tidegate.broker import broker
from tidegate.errors import ApiError, unavailable
from tidegate.wire import gateway_pb2 as pb

log = logging.getLogger("tidegate.edge")

SERVICE = pb.DESCRIPTOR.services_by_name["Gateway"].full_name  # "tidegate.v1.Gateway"
READY_INTERVAL = 1.0  # seconds between health checks of the /readyz conditions


def ms(seconds: float) -> int:
    return int(seconds * 1000)


def _credentials(key: str, cert: str) -> Any:
    """Server TLS from the HTTP port's PEM files (edge.tls_key, edge.tls_cert)."""
    return grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])


def server_options(state: EdgeState) -> list[tuple[str, int]]:
    """grpcio channel arguments from the config (docs/configuration.md [grpc])."""
    g, e = state.config.grpc, state.config.edge
    options = [
        ("grpc.max_receive_message_length", g.max_message_bytes or e.max_body_bytes + 4096),
        ("grpc.max_send_message_length", -1),
        ("grpc.max_concurrent_streams", g.max_concurrent_streams),
        # Both limits: grpcio rejects between the soft and the absolute one
        # only with some probability.
        ("grpc.max_metadata_size", g.max_metadata_bytes),
        ("grpc.absolute_max_metadata_size", g.max_metadata_bytes),
        ("grpc.keepalive_time_ms", ms(g.keepalive_time)),
        ("grpc.keepalive_timeout_ms", ms(g.keepalive_timeout)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", ms(g.min_ping_interval)),
        ("grpc.http2.max_ping_strikes", 2),
        # grpcio sets SO_REUSEPORT by default: two edges would then share a
        # port by accident. Only with edge.reuse_port, as for HTTP.
        ("grpc.so_reuseport", 1 if e.reuse_port else 0),
    ]
    if g.max_connection_age:
        options.append(("grpc.max_connection_age_ms", ms(g.max_connection_age)))
        options.append(("grpc.max_connection_age_grace_ms",
                        ms(g.max_connection_age_grace or e.shutdown_timeout)))
    if g.max_connection_idle:
        options.append(("grpc.max_connection_idle_ms", ms(g.max_connection_idle)))
    return options


class GrpcIngress:
    """The gRPC server of one edge process: start, serve, drain, stop."""

    def __init__(self, state: EdgeState) -> None:
        self.state = state
        self.server: Any = None
        self.health = health_aio.HealthServicer()
        self.slow = SlowWriters(state.config.edge.slow_client_timeout)
        self.calls = 0  # open calls (Generate and Session)
        self.sessions: set[SessionCall] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.port = 0

    async def start(self) -> int:
        """Listen on edge.host:edge.grpc_port (TLS with the HTTP port's
        certificate); returns the bound port."""
        state = self.state
        e = state.config.edge
        server = grpc.aio.server(options=server_options(state))
        handler = grpc.method_handlers_generic_handler(SERVICE, {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, request_deserializer=lenient(pb.GenerateRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
            "Session": grpc.stream_stream_rpc_method_handler(
                self.session, request_deserializer=lenient(pb.SessionRequest),
                response_serializer=pb.GenerateResponse.SerializeToString),
        })
        server.add_generic_rpc_handlers((handler,))
        add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME),
                                            server)
        address = f"{e.host}:{e.grpc_port}"
        ensure_free("edge.grpc_port", e.host, e.grpc_port, reuse_port=e.reuse_port)
        try:
            if e.tls_cert:
                self.port = server.add_secure_port(address, _credentials(e.tls_key, e.tls_cert))
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # taken since the probe: grpcio says no more than this
            raise cannot_listen("edge.grpc_port", e.host, e.grpc_port,
                                OSError(errno.EADDRINUSE, "in use")) from None
        await server.start()
        self.server = server
        await self._set_health(False)
        self._tasks = [asyncio.create_task(self.slow.run(), name="tidegate-grpc-slow"),
                       asyncio.create_task(self._follow_ready(), name="tidegate-grpc-health")]
        log.info("edge %s gRPC on %s:%d%s", state.edge_id, e.host, self.port,
                 " (TLS)" if e.tls_cert else "")
        return self.port

    async def _set_health(self, ready: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if ready
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _follow_ready(self) -> None:
        """Health follows /readyz's conditions, checked every READY_INTERVAL."""
        state = self.state
        while not state.draining:
            try:
                ready = (state.nc.is_connected
                         and await broker.streams_exist(state.js, state.config))
            except Exception as exc:
                log.debug("gRPC health check: %s", exc)
                ready = False
            await self._set_health(ready and not state.draining)
            await asyncio.sleep(READY_INTERVAL)

    async def drain(self) -> None:
        """SIGTERM: NOT_SERVING at once (load balancers stop sending), then
        GOAWAY: no new calls; open ones run on (the edge's session drain tells
        resumable generations to reconnect) for edge.shutdown_timeout."""
        await self.health.enter_graceful_shutdown()
        for call in list(self.sessions):
            call.drain()
        if self.server is not None:
            # Past the sessions' drain (edge.service._drain), which ends what
            # is still open at shutdown_timeout with a retryable error and
            # gives it 2 s to be written: grpcio cancels calls at the grace.
            await self.server.stop(self.state.config.edge.shutdown_timeout + 2.5)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.stop(0)

    # -- Generate ----------------------------------------------------------------

    async def generate(self, req: pb.GenerateRequest | None,
                       context: grpc.aio.ServicerContext[Any, Any]) -> None:
        state = self.state
        self.calls += 1
        failure: ApiError | None = None
        headers: dict[str, str] = {}
        status = 200
        metadata: dict[str, str] = {}
        with contextlib.suppress(ApiError):
            metadata = metadata_of(context)
        api = CHAT.api
        with contextlib.suppress(ApiError):
            api = api_of(req) if req is not None else api
        rt = instrument.RequestTelemetry(state.telemetry, metadata, api)
        if rt.span is not None:
            rt.span.set_attribute("tidegate.transport", "grpc")
        token = rt.activate()
        sink = CallSink(context)
        self.slow.sinks.add(sink)
        try:
            metadata = metadata_of(context)
            principal = authenticate(state, metadata)  # first: no key, no other answer
            if req is None:
                raise undecodable(pb.GenerateRequest)
            if state.draining:
                raise unavailable("This edge is shutting down; retry on another.",
                                  code="edge_draining")
            remaining = context.time_remaining()
            gen = Generation("")
            try:
                async with asyncio.timeout(remaining):
                    failure, headers = await run_generation(state, principal, req, metadata,
                                                            sink, gen, rt, remaining)
            except TimeoutError:
                # The relay was cancelled by the timeout: its work upstream
                # is cancelled (Relay.run's finally), as for a disconnect.
                raise ApiError(504, "The call's deadline passed.", type="server_error",
                               code="deadline_exceeded") from None
            if sink.slow:
                failure = unavailable(f"The client did not read for "
                                      f"{state.config.edge.slow_client_timeout:g}s.",
                                      code="slow_client")
        except ApiError as error:
            failure = error
        except asyncio.CancelledError:
            rt.on_cancel("client_disconnected")
            status = 499
            raise
        except Exception:
            log.exception("gRPC Generate failed")
            failure = ApiError(500, "Internal gateway error.", type="server_error",
                               code="internal_error")
        finally:
            self.calls -= 1
            if failure is not None:
                rt.on_error(failure)
                status = failure.status
                context.set_code(status_of(failure))
                context.set_details(error_details(failure))
                context.set_trailing_metadata(error_trailers(failure, headers))
            rt.finish(status)
            instrument.deactivate(token)

    # -- Session -----------------------------------------------------------------

    async def session(self, requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self.calls += 1
        sink = CallSink(context)
        self.slow.sinks.add(sink)
        try:
            failure = await run_session(self.state, requests, context, sink, self.sessions)
            # A write still in flight past this (a client that reads nothing)
            # is SlowWriters' to end; the call then ends as it can.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.state.config.edge.slow_client_timeout):
                    await sink.settle()
        finally:
            self.calls -= 1
        if failure is not None:
            context.set_code(status_of(failure))
            context.set_details(error_details(failure))
