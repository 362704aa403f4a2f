"""tidegate.broker.link: when an edge counts its NATS link as lost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from tidegate.broker.link import Link, grace, stale_after
from tidegate.config import NatsConfig


@dataclass
class _Client:
    is_connected: bool = True
    is_closed: bool = False


def test_lost_only_after_the_grace_and_reset_by_a_reconnect() -> None:
    nc = _Client()
    link = Link(cast(Any, nc), grace=2.0)
    assert not link.lost(100.0)
    nc.is_connected = False  # nats-py: RECONNECTING
    assert not link.lost(101.0)  # down since 101
    assert not link.lost(102.9)
    assert link.lost(103.0)
    nc.is_connected = True  # reconnected (another node) within or after the grace
    assert not link.lost(104.0)
    nc.is_connected = False
    assert not link.lost(105.0)  # a new loss starts a new grace
    assert link.lost(107.5)


def test_a_closed_client_or_none_is_never_lost() -> None:
    assert not Link(None, 0.0).lost(1e9)  # the relay's default: no link to watch
    link = Link(cast(Any, _Client(is_connected=False, is_closed=True)), grace=0.0)
    assert not link.lost(1e9)  # closing at shutdown is not a partition


def test_bounds_follow_the_ping_settings() -> None:
    cfg = NatsConfig(ping_interval=1.0, max_pings_out=2)
    assert stale_after(cfg) == 3.0
    assert grace(cfg) == 2.0
