"""tidegate.logs: plain and JSON formats, extras on every line, idempotent setup."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from tidegate.config import LoggingConfig
from tidegate.telemetry import logs


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {name: logging.getLogger(name).level for name in logs.COMPONENT_LOGGERS}
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    for name, lvl in levels.items():
        logging.getLogger(name).setLevel(lvl)
    logging.captureWarnings(False)


pytestmark = pytest.mark.usefixtures("restore_logging")


def test_json_lines_carry_extras() -> None:
    out = io.StringIO()
    logs.setup(LoggingConfig(level="INFO", json=True), stream=out)
    log = logs.get("edge")
    assert log.name == "tidegate.edge"
    log.info("stream %s", "done", extra={"request_id": "r1", "session": "s1", "tenant": "t"})
    log.debug("hidden")
    obj = json.loads(out.getvalue().strip())
    assert obj["msg"] == "stream done"
    assert obj["level"] == "INFO"
    assert obj["logger"] == "tidegate.edge"
    assert (obj["request_id"], obj["session"], obj["tenant"]) == ("r1", "s1", "t")
    assert obj["ts"].endswith("Z")


def test_json_exception_and_unserialisable_extra() -> None:
    out = io.StringIO()
    logs.setup(LoggingConfig(json=True), stream=out)
    try:
        raise ValueError("boom")
    except ValueError:
        logs.get("worker").exception("failed", extra={"obj": object()})
    obj = json.loads(out.getvalue().strip())
    assert "ValueError: boom" in obj["exc"]
    assert obj["obj"].startswith("<object")


def test_plain_format_and_levels() -> None:
    out = io.StringIO()
    logs.setup(LoggingConfig(level="DEBUG"), stream=out)
    logs.get("dispatcher").debug("quota", extra={"tenant": "acme", "note": "two words"})
    logging.getLogger("aiohttp.access").info("third-party info is not shown")
    logging.getLogger("aiohttp.access").warning("third-party warning is")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "DEBUG" in lines[0]
    assert "tidegate.dispatcher: quota" in lines[0]
    assert 'tenant=acme note="two words"' in lines[0]
    assert "third-party warning is" in lines[1]


def test_setup_twice_does_not_duplicate_lines() -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.setup(LoggingConfig(), stream=first)
    logs.setup(LoggingConfig(), stream=second)
    logs.get("edge").info("once")
    assert first.getvalue() == ""
    assert second.getvalue().count("once") == 1
