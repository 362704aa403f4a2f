"""One NATS login per edge (``tidegate nats-config --edges``, and ``tidegate up``'s
default), against a real nats-server: a stolen edge login reads its own
replies and inbox only, never another edge's (issue 44 row 7)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.js.errors
import pytest

from tests.pipeline import wait_for
from tests.test_nats_permissions import AuthServer, connect_as
from tidegate.broker import natsconfig
from tidegate.broker.auth import connect_options, load_credentials
from tidegate.config import NatsConfig
from tidegate.errors import ConfigError
from tidegate.wire.subjects import Subjects

pytestmark = [pytest.mark.pipeline]

EDGES = ("edge-1", "edge-2")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    server = AuthServer(tmp_path_factory.mktemp("edgelogins"), edges=EDGES)
    try:
        yield server
    finally:
        server.server.stop()


def test_each_edge_gets_its_own_login_and_no_shared_one(fleet: AuthServer) -> None:
    names = sorted(p.name for p in fleet.auth_dir.glob("*.creds.toml"))
    assert names == ["admin.creds.toml", "dispatcher.creds.toml", "edge.edge-1.creds.toml",
                     "edge.edge-2.creds.toml", "worker.creds.toml"]
    one = load_credentials(natsconfig.creds_file(fleet.auth_dir, "edge.edge-1"))
    assert one["user"] == "tidegate-edge-edge-1"
    assert one["inbox_prefix"] == "_INBOX_edge.edge-1"
    conf = fleet.auth.read_text()
    assert '"tidegate-edge"' not in conf


def test_an_edge_picks_its_own_login_by_its_id(fleet: AuthServer) -> None:
    cfg = NatsConfig(credentials=natsconfig.credentials_setting(fleet.auth_dir))
    opts = connect_options(cfg, "tidegate-edge-edge-2")
    assert (opts["user"], opts["inbox_prefix"]) == ("tidegate-edge-edge-2",
                                                    "_INBOX_edge.edge-2")
    with pytest.raises(ConfigError, match="no login for edge 'edge-9'"):
        connect_options(cfg, "tidegate-edge-edge-9")
    assert connect_options(cfg, "tidegate-worker-w1")["user"] == "tidegate-worker"


def test_the_shared_login_is_gone_once_edges_have_their_own(tmp_path: Path) -> None:
    natsconfig.write(tmp_path, Subjects())
    assert natsconfig.creds_file(tmp_path, "edge").exists()
    natsconfig.write(tmp_path, Subjects(), edges=("a",))
    assert not natsconfig.creds_file(tmp_path, "edge").exists()
    assert natsconfig.creds_file(tmp_path, "edge.a").exists()


async def test_an_edge_reads_its_own_replies_and_no_other_edges(fleet: AuthServer) -> None:
    errors: list[str] = []
    edge1 = await connect_as(fleet, "edge.edge-1", errors)
    worker = await connect_as(fleet, "worker", errors)
    got: list[bytes] = []

    async def on_msg(msg: nats.aio.msg.Msg) -> None:
        got.append(msg.data)

    try:
        await edge1.subscribe("tg.out.edge-1.*", cb=on_msg)
        await edge1.flush()
        await worker.publish("tg.out.edge-1.r1", b"chunk")
        await worker.flush()
        await wait_for(lambda: got == [b"chunk"], 30)
        # JetStream's answers reach its own inbox (no stream yet: the answer says so)
        with pytest.raises(nats.js.errors.NotFoundError):
            await edge1.jetstream().stream_info("TG_REQUESTS")
        assert errors == []
    finally:
        await edge1.close()
        await worker.close()


@pytest.mark.parametrize("subject", ["tg.out.edge-2.*", "tg.out.*.*", "tg.out.>",
                                     "_INBOX_edge.edge-2.>", "_INBOX_edge.>", "_INBOX_worker.>"])
async def test_a_stolen_edge_login_cannot_read_another_edges_replies(fleet: AuthServer,
                                                                     subject: str) -> None:
    errors: list[str] = []
    edge1 = await connect_as(fleet, "edge.edge-1", errors)
    try:
        await edge1.subscribe(subject)
        await edge1.flush()
        await wait_for(lambda: any("violation" in e.lower() for e in errors), 30)
    finally:
        await edge1.close()
    assert any(subject.lower() in e.lower() for e in errors), errors
    await asyncio.sleep(0)
