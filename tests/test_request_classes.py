"""Which class the edge gives a request (tidegate.wire.classes), unit: what a
saturated backend's queue grants first (tests/test_queueing.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from edge.auth import Principal
from edge.publish import build_request
from tidegate.config import Config, ModelConfig
from tidegate.validation.generation import Validated
from tidegate.wire import classes
from tidegate.wire.protocol import Api

MODEL = ModelConfig(name="m")


def klass(api: Api, body: dict[str, Any], stream: bool = False) -> str:
    state = SimpleNamespace(config=Config(), edge_id="e1")
    valid = Validated(api=api, model=MODEL, body={"model": "m", **body}, stream=stream,
                      include_usage=False)
    request = build_request(state, Principal("t", "", "k"), valid, {}, None)  # type: ignore[arg-type]
    return request.klass


@pytest.mark.parametrize(("api", "body", "stream", "expected"), [
    (Api.CHAT, {"messages": []}, True, classes.INTERACTIVE),
    (Api.RESPONSES, {"input": "hi"}, False, classes.INTERACTIVE),
    (Api.RESPONSES, {"input": "hi", "background": True}, False, classes.BACKGROUND),
    (Api.RESPONSES, {"input": "hi", "background": True}, True, classes.BACKGROUND),
    # only a dialect with a background mode has one; a vendor field elsewhere is not it
    (Api.CHAT, {"messages": [], "background": True}, True, classes.INTERACTIVE),
    (Api.RESPONSES, {"input": "hi", "background": "yes"}, False, classes.INTERACTIVE),
])
def test_the_edge_classes_each_request(api: Api, body: dict[str, Any], stream: bool,
                                       expected: str) -> None:
    assert klass(api, body, stream) == expected


def test_classes_rank_in_priority_order_and_an_unknown_one_last() -> None:
    assert [classes.rank(c) for c in classes.CLASSES] == [0, 1, 2]
    assert classes.rank("priority-9") == classes.rank(classes.BATCH)
