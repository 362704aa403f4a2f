"""API key expiry, rotation with overlap and last use, on a live pipeline; and
keys never showing up where they must not (logs, metrics, ``tidegate config``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fleet.cli.common import redacted
from tests.pipeline import DEV_KEY, Pipeline, running_pipeline
from tidegate import config as tgconfig
from tidegate.broker import broker
from tidegate.control import keys as tgkeys

pytestmark = pytest.mark.pipeline

CHAT = "/v1/chat/completions"
BODY = {"model": "tidegate-sim", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]}


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path_factory.mktemp("keys"), module_nats_url,
                                module_redis_url)


def _kv(pipeline: Pipeline, work: Any) -> Any:
    async def main() -> Any:
        nc = await broker.connect(pipeline.config.nats, "tidegate-admin-test")
        try:
            js = broker.jetstream(nc, pipeline.config.nats)
            return await work(await tgkeys.ensure_keys_bucket(js, pipeline.config), js)
        finally:
            await nc.close()
    return asyncio.run(main())


def _status(pipeline: Pipeline, key: str) -> tuple[int, dict[str, Any]]:
    status, body = pipeline.post(CHAT, BODY, key=key)
    return status, json.loads(body) if body else {}


def _until(pipeline: Pipeline, key: str, status: int, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        got, body = _status(pipeline, key)
        if got == status:
            return body
        assert time.monotonic() < deadline, f"still {got} {body}, wanted {status}"
        time.sleep(0.1)


def test_expiry_rotation_overlap_and_last_use(pipeline: Pipeline) -> None:
    async def make(kv: Any, js: Any) -> tuple[str, str]:
        short, _ = await tgkeys.create_key(kv, "acme", "al", expires_in=3.0)
        old, _ = await tgkeys.create_key(kv, "acme", "bo", ["tidegate-sim"])
        return short, old

    short, old = _kv(pipeline, make)
    _until(pipeline, short, 200, 10)  # the edge's watch has it
    _until(pipeline, old, 200, 10)
    error = _until(pipeline, short, 401, 10)["error"]  # 3 s after creation
    assert error["code"] == "expired_api_key"
    assert short not in error["message"]

    old_id = tgkeys.key_digest(old)[:12]

    async def rotate(kv: Any, js: Any) -> Any:
        return await tgkeys.rotate_key(kv, old_id, overlap=3.0)

    new, new_record, old_record = _kv(pipeline, rotate)
    assert (new_record.tenant, new_record.user, new_record.models) == \
        ("acme", "bo", ("tidegate-sim",))
    assert old_record.expires > 0
    _until(pipeline, new, 200, 10)
    # Within the overlap both work; after it only the new one.
    assert _status(pipeline, old)[0] == 200
    assert _until(pipeline, old, 401, 10)["error"]["code"] == "expired_api_key"
    assert _status(pipeline, new)[0] == 200

    # Last use: the edge reports accepted keys to <P>_KEYUSE within seconds,
    # and `tidegate keys list` shows it.
    async def used(kv: Any, js: Any) -> dict[str, float]:
        return await tgkeys.read_last_used(await tgkeys.ensure_last_used_bucket(
            js, pipeline.config))

    deadline = time.monotonic() + 15
    while tgkeys.key_digest(new) not in _kv(pipeline, used):
        assert time.monotonic() < deadline, "the new key's last use never reached KV"
        time.sleep(0.2)
    listed = subprocess.run([sys.executable, "-m", "fleet", "keys", "list", "--json",
                             "--config", str(pipeline.config_path)], capture_output=True,
                            text=True, timeout=30, check=True)
    rows = {r["key_id"]: r for r in json.loads(listed.stdout)}
    assert rows[new_record.key_id]["last_used"] > time.time() - 60
    assert 0 < rows[old_id]["expires"] <= time.time()

    # Keys never in logs or metrics: only key ids are. The edge answering the
    # scrape is the positive event that gives a late log line its chance: its
    # one event loop finished every earlier request's handler first, and each
    # log record is written (stderr, line-buffered) before the call returns.
    # The workers and dispatcher finished theirs before the responses did.
    scraped = pipeline.scrape("edge")
    text = scraped + pipeline.log_text()
    for logs_file in (pipeline.workdir / "logs").glob("*.log"):
        text += logs_file.read_text(errors="replace")
    for key in (short, old, new, DEV_KEY):
        assert key not in text
        assert key[6:] not in text  # not even without its prefix


def test_tidegate_config_never_prints_secrets(tmp_path: Path) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text('[auth]\nkeys = ["sk-static-secret-1"]\ndev_key = "sk-dev-secret-2"\n'
                   '[redis]\nurl = "rediss://tidegate:redis-pass-3@r:6380/0"\n'
                   '[nats]\nurl = "nats://u:nats-pass-4@n:4222"\n'
                   '[[models]]\nname = "m"\nbackend = "openai"\n'
                   'base_url = "http://127.0.0.1:9/v1"\napi_key_env = "BACKEND_KEY"\n')
    out = subprocess.run([sys.executable, "-m", "fleet", "config", "--config", str(cfg)],
                         capture_output=True, text=True, timeout=30, check=True,
                         env={**os.environ, "BACKEND_KEY": "sk-backend-secret-5"}).stdout
    for secret in ("sk-static-secret-1", "sk-dev-secret-2", "redis-pass-3", "nats-pass-4",
                   "sk-backend-secret-5"):
        assert secret not in out
    assert 'api_key_env = "BACKEND_KEY"' in out
    # The redacted config is still a valid config (only the secrets differ).
    back = tgconfig.from_dict(tomllib.loads(out))
    assert back.redis.url == "rediss://tidegate:<redacted>@r:6380/0"
    assert redacted(back).auth.dev_key == "<redacted>"
