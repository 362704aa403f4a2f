"""TLS everywhere, with certificates made by the test (trustme).

* the edge's HTTPS (edge.tls: the server context and the guarded site), with a
  real client verifying the chain, and a plain-HTTP client refused;
* NATS over TLS against a real nats-server, server-verified and mutual
  (client certificate), through the same connect path every tier uses;
* Redis over TLS with an ACL user against a real redis-server, through the
  dispatcher's quota-store client.
"""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp import web

from edge.guard import GuardedSite
from edge.tls import is_loopback, server_tls_context, warn_if_public_plaintext
from fleet.run.servers import NatsServer, free_port
from tidegate.broker import broker
from tidegate.config import EdgeConfig, NatsConfig
from tidegate.control.admin import connect_once
from tidegate.errors import BrokerError, ConfigError


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("tidegate-worker")
    paths = {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key",
             "client_cert": d / "client.pem", "client_key": d / "client.key"}
    ca.cert_pem.write_to_path(str(paths["ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    for blob in server.cert_chain_pems:
        blob.write_to_path(str(paths["cert"]), append=True)
    client.private_key_pem.write_to_path(str(paths["client_key"]))
    for blob in client.cert_chain_pems:
        blob.write_to_path(str(paths["client_cert"]), append=True)
    return paths


@pytest.mark.asyncio
async def test_edge_serves_https_and_wss_and_refuses_plain_http(pki: dict[str, Path]) -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"scheme": request.scheme})

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        async for msg in ws:
            await ws.send_str(f"echo {msg.data}")
        return ws

    app = web.Application()
    app.router.add_get("/hello", hello)
    app.router.add_get("/ws", echo)
    runner = web.AppRunner(app)
    await runner.setup()
    config = EdgeConfig(host="127.0.0.1", port=free_port(), tls_cert=str(pki["cert"]),
                        tls_key=str(pki["key"]))
    site = GuardedSite(runner, config, ssl_context=server_tls_context(config))
    await site.start()
    try:
        client_ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        async with aiohttp.ClientSession() as session:
            async with session.get(f"https://127.0.0.1:{config.port}/hello",
                                   ssl=client_ctx) as resp:
                assert resp.status == 200
                assert await resp.json() == {"scheme": "https"}
            # WebSocket upgrades ride the same TLS listener (wss://).
            async with session.ws_connect(f"wss://127.0.0.1:{config.port}/ws",
                                          ssl=client_ctx) as ws:
                await ws.send_str("tide")
                assert (await ws.receive()).data == "echo tide"
            # Unverifiable without the CA: the certificate is really checked.
            with pytest.raises(aiohttp.ClientConnectorCertificateError):
                await session.get(f"https://127.0.0.1:{config.port}/hello")
            with pytest.raises((aiohttp.ClientError, ConnectionError)):
                await session.get(f"http://127.0.0.1:{config.port}/hello")
    finally:
        await runner.cleanup()


def test_bad_edge_tls_files_are_a_config_error(tmp_path: Path) -> None:
    missing = EdgeConfig(tls_cert=str(tmp_path / "nope.pem"), tls_key=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="tls_cert"):
        server_tls_context(missing)
    assert server_tls_context(EdgeConfig()) is None


def test_public_plaintext_listener_warns(caplog: pytest.LogCaptureFixture) -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        assert is_loopback(host)
    for host in ("0.0.0.0", "", "10.1.2.3", "edge.example"):
        assert not is_loopback(host)
    assert not warn_if_public_plaintext(EdgeConfig(host="127.0.0.1"))
    assert not warn_if_public_plaintext(EdgeConfig(host="0.0.0.0", tls_cert="c", tls_key="k"))
    with caplog.at_level("WARNING", "tidegate.edge"):
        assert warn_if_public_plaintext(EdgeConfig(host="0.0.0.0"))
    assert "without TLS" in caplog.text


def _nats_tls(tmp: Path, pki: dict[str, Path], *, verify_clients: bool) -> NatsServer:
    args = ["--tls", "--tlscert", str(pki["cert"]), "--tlskey", str(pki["key"])]
    if verify_clients:
        args += ["--tlsverify", "--tlscacert", str(pki["ca"])]
    server = NatsServer(tmp, extra_args=args)
    server.start()
    return server


@pytest.mark.pipeline
@pytest.mark.asyncio
async def test_tiers_reach_nats_over_tls(tmp_path: Path, pki: dict[str, Path]) -> None:
    server = _nats_tls(tmp_path / "nats", pki, verify_clients=False)
    try:
        url = f"tls://127.0.0.1:{server.port}"
        nc = await broker.connect(NatsConfig(url=url, tls_ca=str(pki["ca"])), "tidegate-edge-t")
        try:
            js = broker.jetstream(nc, NatsConfig())
            info = await js.account_info()
            assert info.limits is not None
            assert nc.connected_url is not None
            assert nc.connected_url.scheme == "tls"
        finally:
            await nc.close()
    finally:
        server.stop()


@pytest.mark.pipeline
@pytest.mark.asyncio
async def test_mutual_tls_needs_the_client_certificate(tmp_path: Path,
                                                       pki: dict[str, Path]) -> None:
    server = _nats_tls(tmp_path / "nats", pki, verify_clients=True)
    try:
        url = f"tls://127.0.0.1:{server.port}"
        with_cert = NatsConfig(url=url, tls_ca=str(pki["ca"]), tls_cert=str(pki["client_cert"]),
                               tls_key=str(pki["client_key"]))
        nc = await broker.connect(with_cert, "tidegate-worker-t")
        await nc.close()
        # Without a client certificate the handshake fails (the CLI's one-try
        # connect: a service would keep retrying).
        with pytest.raises(BrokerError):
            await connect_once(NatsConfig(url=url, tls_ca=str(pki["ca"]), connect_timeout=3),
                               "tidegate-admin")
    finally:
        server.stop()


def _redis_binaries() -> list[str]:
    """Every redis-server on PATH: a wheel's build may lack TLS, the system's has it."""
    found: dict[str, str] = {}  # resolved -> as found (Debian's is a symlink that
    for directory in os.environ.get("PATH", "").split(os.pathsep):  # reads argv[0])
        candidate = Path(directory) / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            found.setdefault(str(candidate.resolve()), str(candidate))
    return list(found.values())


@pytest.fixture
def redis_tls(tmp_path: Path, pki: dict[str, Path]) -> Iterator[int]:
    for binary in _redis_binaries():
        port = free_port()
        log = tmp_path / f"redis-{port}.log"
        proc = subprocess.Popen(
            [binary, "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(pki["cert"]),
             "--tls-key-file", str(pki["key"]), "--tls-ca-cert-file", str(pki["ca"]),
             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
             "--dir", str(tmp_path), "--user", "default", "off",
             "--user", "tidegate", "on", ">s3cret-pass", "~*", "&*", "+@all"],
            stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        if proc.poll() is not None:
            continue  # this build cannot serve TLS: try the next binary
        try:
            yield port
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        return
    pytest.skip("no redis-server on PATH with TLS support")


@pytest.mark.pipeline
@pytest.mark.asyncio
async def test_quota_store_over_tls_with_an_acl_user(redis_tls: int,
                                                     pki: dict[str, Path]) -> None:
    from dispatcher.quota import connect

    base = f"rediss://tidegate:s3cret-pass@127.0.0.1:{redis_tls}/0"
    client = connect(f"{base}?ssl_ca_certs={pki['ca']}&ssl_cert_reqs=required", 5.0)
    try:
        assert await client.ping()
        assert await client.acl_whoami() == "tidegate"
        await client.set("tg-tls-check", "1")
        assert await client.get("tg-tls-check") == "1"
    finally:
        await client.aclose()
    wrong = connect(f"rediss://tidegate:wrong@127.0.0.1:{redis_tls}/0?ssl_ca_certs={pki['ca']}",
                    5.0)
    try:
        with pytest.raises(Exception, match=r"(?i)auth|password|WRONGPASS"):
            await wrong.ping()
    finally:
        await wrong.aclose()


async def test_grpc_port_serves_tls_with_the_edge_certificate(pki: dict[str, Path]) -> None:
    """edge.grpc_port uses the HTTP port's certificate: a TLS client that
    trusts the CA is answered (health), a plaintext one is not."""
    import types

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from edge.grpc_server import GrpcIngress
    from tidegate import config as tgconfig

    config = tgconfig.from_dict({"edge": {
        "host": "127.0.0.1", "port": free_port(), "grpc_port": free_port(),
        "tls_cert": str(pki["cert"]), "tls_key": str(pki["key"])}})
    # Only the listener is under test: health reads NATS' state, here "not connected".
    state = types.SimpleNamespace(config=config, edge_id="tls", draining=False,
                                  nc=types.SimpleNamespace(is_connected=False))
    ingress = GrpcIngress(state)  # type: ignore[arg-type]
    port = await ingress.start()
    try:
        credentials = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
            answer = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="tidegate.v1.Gateway"), timeout=10)
            assert answer.status == health_pb2.HealthCheckResponse.NOT_SERVING  # no NATS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await ingress.close()
