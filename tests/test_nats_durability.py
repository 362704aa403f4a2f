"""Every NATS tidegate ships fsyncs before it acknowledges (``sync_interval:
always``, docs/reliability.md "Durability"): the embedded server of
``tidegate up`` and the suite, its clusters, deploy/nats-server.conf and the
Helm values. Checked on the running server (``/varz``), not on the text.

A SIGKILL cannot show what a power cut loses (the page cache survives it);
tests/test_nats_cluster.py kills every node at once under load for the rest.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import nats
import pytest
import yaml

from tidegate.run.clusters import NatsCluster
from tidegate.run.servers import NatsServer, free_port

pytestmark = pytest.mark.pipeline
DEPLOY = Path(__file__).resolve().parent.parent / "deploy"


def _jetstream_config(server: NatsServer) -> dict[str, object]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.monitor_port}/varz",
                                timeout=10) as resp:
        config: dict[str, object] = json.loads(resp.read())["jetstream"]["config"]
    return config


def test_the_embedded_server_fsyncs_before_it_acks(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        assert _jetstream_config(server).get("sync_always") is True
    finally:
        server.stop()


def test_nats_servers_own_default_is_not_that(tmp_path: Path) -> None:
    """The check above can fail: nats-server left to itself does not fsync."""
    server = NatsServer(tmp_path / "nats", sync_interval=None)
    server.start()
    try:
        assert not _jetstream_config(server).get("sync_always")
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
    cluster = NatsCluster(tmp_path / "cluster")
    cluster.start()
    try:
        assert [_jetstream_config(n).get("sync_always") for n in cluster.nodes] == [True] * 3
    finally:
        cluster.stop()


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
                        sync_interval=None, extra_args=["-c", str(conf)])
    server.argv = [a for a in server.argv if a not in ("-js", "-sd", str(server.data_dir))]
    server.start()
    try:
        assert _jetstream_config(server).get("sync_always") is True
    finally:
        server.stop()


def test_the_helm_values_fsync_before_they_ack() -> None:
    values = yaml.safe_load((DEPLOY / "k8s" / "nats-values.yaml").read_text())
    assert values["config"]["jetstream"]["merge"]["sync_interval"] == "always"
