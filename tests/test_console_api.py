"""The console's HTTP API (fleet.run.console) against a real pipeline: every
admin endpoint refuses a tenant key (403), no key (401) and bad input (400),
does what the CLI does with the same audit line, and every answer carries the
security headers. The browser side is tests/test_console_browser.py."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.console_helpers import cli, console_log, create_key, running_console
from tests.pipeline import DEV_KEY, Pipeline
from tests.poll import eventually

pytestmark = pytest.mark.pipeline

CHANGES: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (path, a valid body, a bad body)
    ("keys", {"tenant": "acme"}, {"tenant": ""}),
    ("keys/revoke", {"key_id": "0123456789ab"}, {"key_id": "not-hex"}),
    ("policies", {"tenant": "acme", "rpm": 10}, {"tenant": "acme", "rpm": -1}),
    ("policies/delete", {"tenant": "acme"}, {"tenant": 5}),
    ("tenants", {"tenant": "acme", "resumable": True}, {"tenant": "acme", "resumable": "yes"}),
    ("tenants/delete", {"tenant": "acme"}, {"tenant": ""}),
    ("batches/cancel", {"batch_id": "batch_" + "0" * 32}, {"batch_id": "batch_1"}),
]
READS = ["whoami", "status", "usage", "keys", "policies", "tenants", "batches"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory, module_nats_url: str,
             module_redis_url: str) -> Iterator[Pipeline]:
    p = Pipeline(tmp_path_factory.mktemp("console-api"), module_nats_url, module_redis_url,
                 overrides={"nats": {"subject_prefix": "c" + uuid.uuid4().hex[:8]}})
    try:
        p.start()
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def console(pipeline: Pipeline) -> Iterator[str]:
    with running_console(pipeline) as url:
        yield url


@pytest.fixture(scope="module")
def admin_key(pipeline: Pipeline) -> str:
    return str(create_key(pipeline, "ops", "--admin")["key"])


@pytest.fixture(scope="module")
def tenant_key(pipeline: Pipeline) -> str:
    return str(create_key(pipeline, "acme")["key"])


async def call(url: str, path: str, key: str | None, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any, Any]:
    """(status, JSON body, headers) of GET (body None) or POST (JSON body)."""
    h = dict(headers or {})
    if key is not None:
        h["Authorization"] = f"Bearer {key}"
    async with aiohttp.ClientSession() as session:
        if body is None:
            resp = await session.get(f"{url}/console/api/{path}", headers=h)
        else:
            h.setdefault("Content-Type", "application/json")
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            resp = await session.post(f"{url}/console/api/{path}", data=data, headers=h)
        async with resp:
            return resp.status, await resp.json(content_type=None), resp.headers


@pytest.mark.parametrize("path", READS)
async def test_reads_need_an_admin_key(console: str, admin_key: str, tenant_key: str,
                                       path: str) -> None:
    for key, status in ((None, 401), ("sk-tg-nonsense", 401), (tenant_key, 403),
                        (DEV_KEY, 403)):
        got, body, _ = await call(console, path, key)
        assert got == status, (path, key, body)
        assert body["error"]["type"] in ("authentication_error", "permission_error")
    got, body, headers = await call(console, path, admin_key)
    assert got == 200, body
    assert "script-src 'self'" in headers["Content-Security-Policy"]
    assert "set-cookie" not in {k.lower() for k in headers}


@pytest.mark.parametrize(("path", "good", "bad"), CHANGES)
async def test_changes_refuse_tenant_keys_and_bad_input(
        console: str, admin_key: str, tenant_key: str, path: str, good: dict[str, Any],
        bad: dict[str, Any]) -> None:
    got, body, _ = await call(console, path, tenant_key, good)
    assert got == 403, body
    assert body["error"]["code"] == "not_admin"
    got, body, _ = await call(console, path, None, good)
    assert got == 401, body
    for hostile in (bad, {**good, "surprise": 1}, b"{not json", b"[1, 2]",
                    {**good, **{next(iter(good)): "\x00"}}):
        got, body, _ = await call(console, path, admin_key, hostile)
        assert got == 400, (hostile, body)
        assert body["error"]["message"]
    got, body, _ = await call(console, path, admin_key, b'{"tenant": "' + b"x" * 20000 + b'"}')
    assert got == 413, body
    # CSRF: a change from another origin, or not as JSON, is refused.
    got, body, _ = await call(console, path, admin_key, good,
                              headers={"Origin": "https://evil.example"})
    assert got == 403, body
    got, body, _ = await call(console, path, admin_key, good,
                              headers={"Content-Type": "text/plain"})
    assert got == 415, body


async def test_usage_window_is_checked(console: str, admin_key: str) -> None:
    got, body, _ = await call(console, "usage?window=year", admin_key)
    assert got == 400, body
    got, body, _ = await call(console, "usage?window=day", admin_key)
    assert got == 200, body
    assert body["window"] == "day"


async def test_admin_changes_match_the_cli(pipeline: Pipeline, console: str,
                                           admin_key: str) -> None:
    tenant = "t-" + uuid.uuid4().hex[:6]
    # keys: create, see it in `keys list`, revoke, gone.
    got, created, _ = await call(console, "keys", admin_key,
                                 {"tenant": tenant, "user": "u1", "models": ["sim"]})
    assert got == 200, created
    assert created["key"].startswith("sk-tg-")
    assert created["models"] == ["tidegate-sim"]  # the alias, as the CLI stores it
    listed = json.loads(cli(pipeline, "keys", "list", "--json").stdout)
    assert created["key_id"] in {k["key_id"] for k in listed}
    got, body, _ = await call(console, "keys/revoke", admin_key, {"key_id": created["key_id"]})
    assert got == 200, body
    got, body, _ = await call(console, "keys/revoke", admin_key, {"key_id": created["key_id"]})
    assert got == 404, body
    listed = json.loads(cli(pipeline, "keys", "list", "--json").stdout)
    assert created["key_id"] not in {k["key_id"] for k in listed}
    # policies: set (a zero-only policy is refused as the CLI refuses it), delete.
    got, body, _ = await call(console, "policies", admin_key, {"tenant": tenant, "rpm": 0})
    assert got == 400, body
    assert "every limit given is 0" in body["error"]["message"]
    got, body, _ = await call(console, "policies", admin_key, {"tenant": tenant, "rpm": 7})
    assert got == 200, body
    policies = json.loads(cli(pipeline, "policy", "list", "--json").stdout)
    assert any(p["tenant"] == tenant and p["rpm"] == 7 for p in policies)
    got, body, _ = await call(console, "policies/delete", admin_key, {"tenant": tenant})
    assert got == 200, body
    got, body, _ = await call(console, "policies/delete", admin_key, {"tenant": tenant})
    assert got == 404, body
    # tenant settings: a grace past resume.max_grace is refused, as by the CLI.
    got, body, _ = await call(console, "tenants", admin_key,
                              {"tenant": tenant, "resumable": True, "grace": 10**9})
    assert got == 400, body
    got, body, _ = await call(console, "tenants", admin_key,
                              {"tenant": tenant, "resumable": True, "grace": 5})
    assert got == 200, body
    tenants = json.loads(cli(pipeline, "tenant", "list", "--json").stdout)
    assert {"tenant": tenant, "resumable": True, "grace": 5.0, "tier": ""} in tenants
    # a tier the config does not have is refused, as by the CLI
    got, body, _ = await call(console, "tenants", admin_key,
                              {"tenant": tenant, "resumable": True, "tier": "gold"})
    assert got == 400, body
    got, body, _ = await call(console, "tenants/delete", admin_key, {"tenant": tenant})
    assert got == 200, body
    # batches: an unknown batch is 404.
    got, body, _ = await call(console, "batches/cancel", admin_key,
                              {"batch_id": "batch_" + "f" * 32})
    assert got == 404, body

    # The audit lines: the console's, naming the admin key, as the CLI's do.
    admin_id = (await call(console, "whoami", admin_key))[1]["key_id"]
    cli_line = cli(pipeline, "policy", "set", "--tenant", tenant, "--rpm", "3").stderr
    assert f"audit by=cli action=policy.set tenant={tenant} model=* user=* rpm=3" in cli_line

    def logged() -> bool:
        text = console_log(pipeline)
        return all(f"audit by=console:{admin_id} action={a}" in text for a in (
            "keys.create", "keys.revoke", "policy.set", "policy.delete", "tenant.set",
            "tenant.delete"))

    await eventually(logged, 30, "the console's audit lines", step=0.5)
    assert created["key"] not in console_log(pipeline)


async def test_page_is_static_and_holds_no_secret(console: str, pipeline: Pipeline,
                                                  admin_key: str) -> None:
    async with aiohttp.ClientSession() as session:
        for path in ("/console", "/console/static/console.js", "/console/static/console.css"):
            async with session.get(console + path) as resp:
                assert resp.status == 200
                text = await resp.text()
                assert "Content-Security-Policy" in resp.headers
                assert resp.headers["X-Frame-Options"] == "DENY"
                for secret in (DEV_KEY, admin_key, pipeline.config.redis.url):
                    assert secret not in text
                assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
                assert "https://" not in text
        async with session.get(console + "/console/static/../../etc/passwd") as resp:
            assert resp.status == 404
        async with session.get(console + "/console/static/index.html") as resp:
            assert resp.status == 404


async def test_a_foreign_host_name_is_refused_before_anything_else(
        console: str, admin_key: str) -> None:
    """DNS rebinding: a page from evil.example, its name pointed at 127.0.0.1,
    sends ``Host: evil.example:<port>`` and, being same-origin with itself, a
    matching ``Origin``. The admin key is still needed, but the console
    answers such a host nothing at all."""
    port = console.rsplit(":", 1)[1]
    foreign = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"}
    status, body, headers = await call(console, "whoami", admin_key, headers=foreign)
    assert (status, body["error"]["code"]) == (403, "untrusted_host")
    assert headers.get("Content-Security-Policy")  # the security headers still go out
    status, _, _ = await call(console, "keys", admin_key, {"tenant": "acme"}, headers=foreign)
    assert status == 403
    for own in (f"localhost:{port}", f"127.0.0.1:{port}"):
        status, body, _ = await call(console, "whoami", admin_key, headers={"Host": own})
        assert status == 200, body


def test_trusted_host_names() -> None:
    from fleet.run.console import trusted_host

    assert trusted_host("127.0.0.1:8090", "127.0.0.1")
    assert trusted_host("[::1]:8090", "127.0.0.1")
    assert trusted_host("localhost", "127.0.0.1")
    assert trusted_host("ops.internal:8090", "ops.internal")
    assert not trusted_host("evil.example:8090", "127.0.0.1")
    assert not trusted_host("localhost.evil.example", "127.0.0.1")
    assert not trusted_host("", "127.0.0.1")
    assert not trusted_host(None, "127.0.0.1")
    assert not trusted_host("[bad", "127.0.0.1")
