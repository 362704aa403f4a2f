"""``tidegate console``: the operator console, one page in a browser.

A process of its own, not an edge route: it needs the ``admin`` NATS user,
which an internet-facing edge must not hold. ``tidegate up`` starts one,
bound to 127.0.0.1 unless told otherwise; it reuses ``status``'s reader and
the CLI's audited operations (:mod:`tidegate.control.operations`).

Invariants: every ``/console/api/`` call carries an admin key, looked up per
call (401 without, 403 for a tenant key); no cookie is ever set; changes are
JSON ``POST`` s from this server's ``Origin`` only; a foreign ``Host`` is refused
(DNS rebinding, :func:`trusted_host`); page, script and style are packaged
files under a Content-Security-Policy of this origin only. Docs: docs/console.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nats.js.errors
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from fleet.run.console_data import Sampler, UsageFollower
from tidegate.broker import broker
from tidegate.config import Config
from tidegate.control import batch_admin, operations
from tidegate.control import keys as tgkeys
from tidegate.control.admin import NotFound, UsageError
from tidegate.control.batches import open_stores
from tidegate.control.usage_stats import WINDOWS, UsageStats
from tidegate.errors import BrokerError, ProtocolError

log = logging.getLogger("tidegate.console")

ASSETS = Path(__file__).with_name("console_assets")
STATIC = {"console.js": "text/javascript", "console.css": "text/css"}
MAX_BODY = 16 * 1024  # an admin form is a few hundred bytes

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
           "X-Frame-Options": "DENY", "Referrer-Policy": "no-referrer",
           "Cache-Control": "no-store", "Cross-Origin-Opener-Policy": "same-origin",
           "Cross-Origin-Resource-Policy": "same-origin"}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiProblem(Exception):
    """An OpenAI-style error answer."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 code: str = "") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type,
                                            "code": self.code or None, "param": None}},
                                 status=self.status)


class Console:
    """The console's state: NATS, the sampler, usage; and its routes."""

    def __init__(self, config: Config, nc: NATS, data_dir: Path | None,
                 interval: float = 2.0, host: str = "127.0.0.1") -> None:
        self.config = config
        self.host = host  # the address it is bound to (trusted_host)
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=config.nats.request_timeout)
        self.usage = UsageStats()
        self.sampler = Sampler(nc, config, data_dir, self.usage, interval)
        self.follower = UsageFollower(nc, config, self.usage)
        self.keys_kv: KeyValue | None = None  # bound on the first sign-in
        # The config's static keys (auth.keys, the dev key) are tenant keys.
        self.static_keys = {tgkeys.key_digest(k) for k in config.api_keys()}

    # -- access ------------------------------------------------------------

    async def admin_of(self, request: web.Request) -> str:
        """The admin key id of the caller (401 without a known key, 403 for a
        key that is not an admin key)."""
        header = request.headers.get("Authorization", "")
        scheme, _, key = header.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise ApiProblem(401, "Send an admin API key as 'Authorization: Bearer KEY'.",
                             "authentication_error", "missing_api_key")
        try:
            digest = tgkeys.key_digest(key)
        except UnicodeEncodeError:
            digest = ""
        record: tgkeys.KeyRecord | None = None
        if digest:
            if self.keys_kv is None:
                self.keys_kv = await tgkeys.ensure_keys_bucket(self.js, self.config)
            kv = self.keys_kv
            try:
                entry = await kv.get(digest)
                record = tgkeys.KeyRecord.decode(entry.value) if entry.value else None
            except (nats.js.errors.KeyNotFoundError, ProtocolError):
                record = None
        if record is None and digest in self.static_keys:
            raise ApiProblem(403, "The console needs an admin key (`tidegate keys create "
                                  "--admin`); a key from the config file is a tenant key.",
                             "permission_error", "not_admin")
        if record is None:
            raise ApiProblem(401, "Incorrect API key provided (it is not repeated here).",
                             "authentication_error", "invalid_api_key")
        if record.expired(time.time()):
            raise ApiProblem(401, f"This API key ({record.key_id}) has expired.",
                             "authentication_error", "expired_api_key")
        if not record.admin:
            raise ApiProblem(403, "The console needs an admin key (`tidegate keys create "
                                  "--admin`); this is a tenant key.",
                             "permission_error", "not_admin")
        return f"console:{digest[:tgkeys.KEY_ID_LENGTH]}"

    # -- pages -------------------------------------------------------------

    async def page(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(ASSETS / "index.html",
                                headers={"Content-Type": "text/html; charset=utf-8"})

    async def static(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        if name not in STATIC:
            raise ApiProblem(404, "no such file", code="not_found")
        return web.FileResponse(ASSETS / name,
                                headers={"Content-Type": f"{STATIC[name]}; charset=utf-8"})

    # -- reading -----------------------------------------------------------

    async def whoami(self, request: web.Request, by: str) -> dict[str, Any]:
        return {"key_id": by.removeprefix("console:"), "nats": self.config.nats.url}

    async def status(self, request: web.Request, by: str) -> dict[str, Any]:
        return self.sampler.view()

    async def usage_report(self, request: web.Request, by: str) -> dict[str, Any]:
        window = request.query.get("window", "hour")
        if window not in WINDOWS:
            raise ApiProblem(400, f"window must be one of {', '.join(WINDOWS)}, got "
                                  f"{window[:40]!r}", code="invalid_window")
        return {**self.usage.report(window, time.time()), "records": self.usage.records}

    async def keys(self, request: web.Request, by: str) -> dict[str, Any]:
        return {"data": await operations.list_keys(self.js, self.config)}

    async def policies(self, request: web.Request, by: str) -> dict[str, Any]:
        return {"data": await operations.list_policies(self.js, self.config)}

    async def tenants(self, request: web.Request, by: str) -> dict[str, Any]:
        return {"data": await operations.list_tenants(self.js, self.config)}

    async def batches(self, request: web.Request, by: str) -> dict[str, Any]:
        stores = await open_stores(self.js, self.config)
        now = time.time()
        return {"data": [batch_admin.row(b, now) for b in await stores.list_batches(None)]}

    # -- changing (tidegate.control.operations: the CLI's checks and audit) --

    async def key_create(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"tenant", "user", "models", "expires_in", "admin"})
        models = _strings(body.get("models", []), "models")
        key, record = await operations.create_key(
            self.js, self.config, by, _text(body, "tenant"), _text(body, "user", ""),
            models, body.get("expires_in", 0.0), _flag(body, "admin"))
        return {"key": key, **record.as_dict(), "admin": record.admin}

    async def key_revoke(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"key_id"})
        await operations.revoke_key(self.js, self.config, by, _text(body, "key_id"))
        return {"revoked": body["key_id"]}

    async def policy_set(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"tenant", "model", "user", "rpm", "tpm", "concurrency"})
        rule = operations.policy(self.config, _text(body, "tenant", ""),
                                 _text(body, "model", ""), _text(body, "user", ""),
                                 body.get("rpm"), body.get("tpm"), body.get("concurrency"))
        await operations.set_policy(self.js, self.config, by, rule)
        return {"policy": rule.as_dict()}

    async def policy_delete(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"tenant", "model", "user"})
        probe = operations.policy(self.config, _text(body, "tenant", ""),
                                  _text(body, "model", ""), _text(body, "user", ""),
                                  verb="delete")
        await operations.delete_policy(self.js, self.config, by, probe)
        return {"deleted": probe.as_dict()}

    async def tenant_set(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"tenant", "resumable", "grace", "tier"})
        settings = operations.tenant_settings(self.config, _text(body, "tenant"),
                                              body.get("resumable"), body.get("grace"),
                                              body.get("tier", ""))
        await operations.set_tenant(self.js, self.config, by, settings)
        return {"tenant": settings.tenant, "resumable": settings.resumable,
                "grace": settings.grace, "tier": settings.tier}

    async def tenant_delete(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"tenant"})
        await operations.delete_tenant(self.js, self.config, by, _text(body, "tenant"))
        return {"deleted": body["tenant"]}

    async def batch_cancel(self, request: web.Request, by: str) -> dict[str, Any]:
        body = await _body(request, {"batch_id"})
        batch = await operations.cancel_batch(self.js, self.config, by,
                                              _text(body, "batch_id"))
        return {"id": batch.id, "status": str(batch.status)}

    # -- the app -----------------------------------------------------------

    def api(self, handler: Callable[[web.Request, str], Awaitable[dict[str, Any]]],
            change: bool = False) -> Handler:
        """An API route: admin key, same origin for changes, errors as JSON."""

        async def route(request: web.Request) -> web.StreamResponse:
            try:
                if change:
                    _same_origin(request)
                by = await self.admin_of(request)
                return web.json_response(await handler(request, by))
            except ApiProblem as problem:
                return problem.response()
            except UsageError as exc:
                return ApiProblem(400, str(exc), code="invalid_value").response()
            except NotFound as exc:
                return ApiProblem(404, str(exc), code="not_found").response()
            except (BrokerError, nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                log.warning("console: %s %s: %s", request.method, request.path, exc)
                return ApiProblem(503, "NATS did not answer; try again.", "api_error",
                                  "broker_unavailable").response()

        return route

    def app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[_headers])
        app[BOUND] = self.host
        r = app.router
        r.add_get("/", _to_console)
        r.add_get("/console", self.page)
        r.add_get("/console/", self.page)
        r.add_get("/console/static/{name}", self.static)
        for path, handler in (("whoami", self.whoami), ("status", self.status),
                              ("usage", self.usage_report), ("keys", self.keys),
                              ("policies", self.policies), ("tenants", self.tenants),
                              ("batches", self.batches)):
            r.add_get(f"/console/api/{path}", self.api(handler))
        for path, handler in (("keys", self.key_create), ("keys/revoke", self.key_revoke),
                              ("policies", self.policy_set),
                              ("policies/delete", self.policy_delete),
                              ("tenants", self.tenant_set),
                              ("tenants/delete", self.tenant_delete),
                              ("batches/cancel", self.batch_cancel)):
            r.add_post(f"/console/api/{path}", self.api(handler, change=True))
        return app


async def _to_console(request: web.Request) -> web.StreamResponse:
    raise web.HTTPFound("/console")


BOUND: web.AppKey[str] = web.AppKey("bound", str)


def trusted_host(host: str | None, bound: str) -> bool:
    """Whether a request's ``Host`` header names this console: an IP address,
    ``localhost``, the host it is bound to, or this machine's own name. Any
    other name reached it through someone's DNS (rebinding), not a link the
    operator followed."""
    if not host:
        return False
    try:
        name = urlsplit(f"//{host}").hostname
    except ValueError:
        return False
    if not name:
        return False
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        pass
    own = {"localhost", bound.lower(), socket.gethostname().lower(), socket.getfqdn().lower()}
    return name.rstrip(".") in own


@web.middleware
async def _headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        if not trusted_host(request.headers.get("Host"), request.app[BOUND]):
            raise ApiProblem(403, "this console answers only to its own host names "
                                  "(an IP address, localhost, or its bind host)",
                             "permission_error", "untrusted_host")
        response = await handler(request)
    except ApiProblem as problem:
        response = problem.response()
    except web.HTTPRequestEntityTooLarge:
        response = ApiProblem(413, f"request body over {MAX_BODY} bytes",
                              code="body_too_large").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            exc.headers.update(HEADERS)
            raise
        response = ApiProblem(exc.status, exc.reason, code="not_found"
                              if exc.status == 404 else "").response()
    response.headers.update(HEADERS)
    return response


def _same_origin(request: web.Request) -> None:
    """A change must come from this console's own page (CSRF): JSON, and no
    foreign ``Origin`` (browsers send one on every cross-site POST)."""
    if request.content_type != "application/json":
        raise ApiProblem(415, "send the change as application/json", code="unsupported_media")
    origin = request.headers.get("Origin")
    if origin is not None and origin != f"{request.scheme}://{request.host}":
        raise ApiProblem(403, "cross-origin change refused", "permission_error",
                         "cross_origin")


async def _body(request: web.Request, allowed: set[str]) -> dict[str, Any]:
    try:
        body = json.loads(await request.read())
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ValueError, UnicodeDecodeError):
        raise ApiProblem(400, "the body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiProblem(400, "the body must be a JSON object", code="invalid_json")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiProblem(400, f"unknown field(s): {', '.join(repr(u[:40]) for u in unknown)}",
                         code="unknown_field")
    return body


def _text(body: dict[str, Any], name: str, default: str | None = None) -> str:
    value = body.get(name, default)
    if value is None:
        raise ApiProblem(400, f"{name} is required", code="missing_field")
    if not isinstance(value, str) or len(value) > 256 or any(ord(c) < 32 for c in value):
        raise ApiProblem(400, f"{name} must be a string of at most 256 printable characters",
                         code="invalid_value")
    return value


def _strings(value: object, name: str) -> list[str]:
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",")] if value.strip() else []
    if not isinstance(value, list) or len(value) > 64 or not all(
            isinstance(v, str) and v and len(v) <= 256 for v in value):
        raise ApiProblem(400, f"{name} must be a list of non-empty names", code="invalid_value")
    return value


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise ApiProblem(400, f"{name} must be true or false", code="invalid_value")
    return value


async def serve(config: Config, host: str, port: int, data_dir: Path | None,
                interval: float = 2.0, ready: Callable[[str], None] | None = None) -> None:
    """Run the console until cancelled."""
    nc = await broker.connect(config.nats, "tidegate-console")
    console = Console(config, nc, data_dir, interval, host)
    runner = web.AppRunner(console.app(), access_log=None)
    await runner.setup()
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(console.follower.run(), name="tidegate-console-usage")
            tg.create_task(console.sampler.run(), name="tidegate-console-sampler")
            site = web.TCPSite(runner, host, port)
            await site.start()
            url = f"http://{host if ':' not in host else f'[{host}]'}:{port}/console"
            log.info("console listening on %s", url)
            if ready is not None:
                ready(url)
    finally:
        await runner.cleanup()
        with contextlib.suppress(Exception):
            await broker.close(nc)


def run(config: Config, host: str = "127.0.0.1", port: int = 8090,
        data_dir: Path | None = None, interval: float = 2.0) -> int:
    """``tidegate console``; its exit code (Ctrl-C or SIGTERM: 0)."""
    import signal

    async def main() -> None:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        if task is not None:
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await serve(config, host, port, data_dir, interval,
                        lambda url: print(f"tidegate console: {url}", flush=True))

    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    return 0
