"""Every NATS tidegate ships fsyncs before it acknowledges (``sync_interval:
always``, docs/reliability.md "Durability") and pings its idle clients every 2 s
(a cut client's subscriptions go in about 6 s): the embedded server of
``tidegate up`` and the suite, its clusters, deploy/nats-server.conf and the
Helm values. Checked on the running server (``/varz``), not on the text.

A SIGKILL cannot show what a power cut loses (the page cache survives it);
tests/test_nats_cluster.py kills every node at once under load for the rest.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest
import yaml

from fleet.run import nats_sync
from fleet.run.clusters import NatsCluster
from fleet.run.servers import NatsServer, free_port

pytestmark = pytest.mark.pipeline
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _varz(server: NatsServer) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz",
                                timeout=10) as resp:
        varz: dict[str, object] = json.loads(resp.read())
    return varz


def _jetstream_config(server: NatsServer) -> dict[str, object]:
    config: dict[str, object] = _varz(server)["jetstream"]["config"]  # type: ignore[index]
    return config


def _pings(server: NatsServer) -> tuple[object, object]:
    """(seconds between the server's pings of an idle client, unanswered
    pings before it drops one)."""
    varz = _varz(server)
    return int(varz["ping_interval"]) / 1e9, varz["ping_max"]  # type: ignore[call-overload]


def test_the_embedded_server_fsyncs_before_it_acks(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        assert _jetstream_config(server).get("sync_always") is True
        assert _pings(server) == (2.0, 2)
    finally:
        server.stop()


_SUBSCRIBER = """
import asyncio, sys, nats
async def ignore(msg):
    pass
async def main():
    nc = await nats.connect(sys.argv[1], ping_interval=3600)
    await nc.subscribe("tg.ctl.cut", cb=ignore)
    await nc.flush()
    print("subscribed", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_client_cut_without_a_word_loses_its_subscriptions(tmp_path: Path) -> None:
    """A stopped client (its socket open, nothing answered: a partition as the
    server sees it) holds its subscriptions until the server's pings give up:
    about 6 s with tidegate's, 4 minutes with nats-server's own (2 min apart,
    see the test below; not timed here: a CI run once saw a plain server drop
    a stopped client sooner). Until then the edges' liveness probe takes a
    cut worker for alive."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    client = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _SUBSCRIBER, server.url, stdout=asyncio.subprocess.PIPE)
    nc = await nats.connect(server.url)
    try:
        assert client.stdout is not None
        assert (await client.stdout.readline()).strip() == b"subscribed"
        client.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        gone = False
        while not gone and time.monotonic() - stopped < 20:
            try:
                await nc.request("tg.ctl.cut", b"", timeout=0.5)
            except nats.errors.NoRespondersError:
                gone = True
            except nats.errors.TimeoutError:
                await asyncio.sleep(0.2)
        assert gone, "the stopped client's subscription is still there after 20 s"
    finally:
        await nc.close()
        if client.returncode is None:
            client.kill()
        await client.wait()
        server.stop()


def test_nats_servers_own_default_is_not_that(tmp_path: Path) -> None:
    """The check above can fail: nats-server left to itself does not fsync."""
    server = NatsServer(tmp_path / "nats", sync_interval=None, ping_interval=None)
    server.start()
    try:
        assert not _jetstream_config(server).get("sync_always")
        assert _pings(server) == (120.0, 2), "nats-server's own client pings"
    finally:
        server.stop()


async def test_a_callers_own_config_is_kept_beside_it(tmp_path: Path) -> None:
    """``tidegate up`` passes its auth.conf with ``-c``: both hold."""
    conf = tmp_path / "auth.conf"
    conf.write_text('authorization { user: "u", password: "p" }\nmax_payload: 8192\n')
    server = NatsServer(tmp_path / "nats", extra_args=["-c", str(conf)])
    server.start()
    try:
        assert _jetstream_config(server).get("sync_always") is True
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(server.url, allow_reconnect=False, max_reconnect_attempts=0,
                               connect_timeout=5)
        nc = await nats.connect(server.url, user="u", password="p")
        assert nc.max_payload == 8192
        await nc.close()
    finally:
        server.stop()


def test_every_cluster_node_fsyncs_before_it_acks(tmp_path: Path) -> None:
    """... and pings its clients every 2 s, its routes at nats-server's own
    2 min: at 2 s a node cut from its peers dropped its routes, and the
    cluster did not serve within 10 s of the heal (the partition runs,
    tests/test_partitions.py, check the behaviour under netns)."""
    cluster = NatsCluster(tmp_path / "cluster")
    cluster.start()
    try:
        assert [_jetstream_config(n).get("sync_always") for n in cluster.nodes] == [True] * 3
        assert [_pings(n) for n in cluster.nodes] == [(2.0, 2)] * 3
        for node in cluster.nodes:
            conf = (node.data_dir / nats_sync.SETTINGS_CONF).read_text()
            assert f'cluster {{ ping_interval: "{nats_sync.ROUTE_PING}" }}' in conf, conf
    finally:
        cluster.stop()


def test_a_single_server_gets_no_cluster_block(tmp_path: Path) -> None:
    """A cluster block would replace one of the caller's own -c file."""
    args = nats_sync.with_server_settings(tmp_path, [], sync_interval="always",
                                          ping_interval="2s")
    assert "cluster" not in (tmp_path / nats_sync.SETTINGS_CONF).read_text()
    assert args == ["-c", str(tmp_path / nats_sync.SETTINGS_CONF)]


def test_the_deploy_config_fsyncs_before_it_acks(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The file as shipped, but for its store_dir (here: this test's) and the
    # server name it takes from the environment.
    text = (DEPLOY / "nats-server.conf").read_text()
    assert 'store_dir: "/data/jetstream"' in text
    conf = tmp_path / "nats-server.conf"
    conf.write_text(text.replace("/data/jetstream", str(tmp_path / "js")))
    monkeypatch.setenv("SERVER_NAME", "nats-1")
    server = NatsServer(tmp_path / "nats", port=free_port(), monitor_port=free_port(),
                        sync_interval=None, ping_interval=None,
                        extra_args=["-c", str(conf)])
    server.argv = [a for a in server.argv if a not in ("-js", "-sd", str(server.data_dir))]
    server.start()
    try:
        assert _jetstream_config(server).get("sync_always") is True
        assert _pings(server) == (2.0, 2)
    finally:
        server.stop()


def test_the_helm_values_fsync_before_they_ack() -> None:
    values = yaml.safe_load((DEPLOY / "k8s" / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["merge"]["sync_interval"] == "always"
    assert values["config"]["merge"] == {"ping_interval": "2s", "ping_max": 2}
