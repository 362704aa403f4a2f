"""``tidegate keys`` and ``tidegate policy`` as a user runs them: subprocesses
against a real nats-server, and once end to end against a running pipeline.

Each test uses its own subject prefix (so its own TG_KEYS / TG_POLICIES
buckets) on one nats-server per module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fleet.run.servers import ManagedProcess, find_nats_server, free_port
from tests.pipeline import Pipeline, running_pipeline

pytestmark = pytest.mark.usefixtures("clean_env")

UNREACHABLE = "nats://127.0.0.1:1"


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TIDEGATE_")}
    return subprocess.run([sys.executable, "-m", "fleet", *args], capture_output=True,
                          text=True, timeout=timeout, env={**base, **(env or {})})


class Cli:
    """The CLI bound to one NATS server and one subject prefix."""

    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.env = {"TIDEGATE__NATS__SUBJECT_PREFIX": prefix}

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, "--nats-url", self.url, env=self.env)

    def ok(self, *args: str) -> str:
        result = self(*args)
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        return result.stdout

    def json(self, *args: str) -> list[dict[str, object]]:
        value = json.loads(self.ok(*args, "--json"))
        assert isinstance(value, list)
        return value


@pytest.fixture
def cli(module_nats_url: str, request: pytest.FixtureRequest) -> Cli:
    prefix = "t" + format(abs(hash(request.node.nodeid)) % 10**8, "d")
    return Cli(module_nats_url, prefix)


# --------------------------------------------------------------------------
# keys
# --------------------------------------------------------------------------


def test_keys_create_list_revoke(cli: Cli) -> None:
    result = cli("keys", "create", "--tenant", "acme", "--user", "alice",
                 "--models", "sim,other-model")
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(":", 1) for line in result.stdout.splitlines())
    key, key_id = lines["key"].strip(), lines["key_id"].strip()
    assert key.startswith("sk-tg-")
    assert len(key_id) == 12
    assert lines["tenant"].strip() == "acme"
    assert lines["models"].strip() == "tidegate-sim,other-model"  # alias -> configured name
    assert "not shown again" in result.stderr
    assert "'other-model' is not in this config" in result.stderr

    created = json.loads(cli.ok("keys", "create", "--tenant", "beta", "--json"))
    assert set(created) == {"key", "key_id", "tenant", "user", "models", "created", "expires"}
    assert (created["tenant"], created["user"], created["models"]) == ("beta", "", [])

    listed = cli.json("keys", "list")
    assert [k["key_id"] for k in listed] == [key_id, created["key_id"]]
    assert listed[0] == {"key_id": key_id, "tenant": "acme", "user": "alice",
                         "models": ["tidegate-sim", "other-model"],
                         "created": listed[0]["created"], "expires": 0.0, "last_used": 0.0}
    table = cli.ok("keys", "list")
    assert table.splitlines()[0].split() == ["KEY_ID", "TENANT", "USER", "MODELS", "ADMIN",
                                             "CREATED", "EXPIRES", "LAST_USED"]
    # An admin key (it may sign in to the console) says so; a tenant key's
    # record has no admin field at all.
    ops = json.loads(cli.ok("keys", "create", "--tenant", "ops", "--admin", "--json"))
    assert ops["admin"] is True
    assert {k["key_id"]: k.get("admin") for k in cli.json("keys", "list")}[ops["key_id"]]
    assert "admin" not in listed[0]
    cli.ok("keys", "revoke", ops["key_id"])
    assert key_id in table
    assert "all" in table  # beta's key may use any model
    for output in (table, json.dumps(listed)):
        assert key not in output
        assert created["key"] not in output

    assert cli.ok("keys", "revoke", key_id).strip() == f"revoked key {key_id}"
    assert [k["key_id"] for k in cli.json("keys", "list")] == [created["key_id"]]
    again = cli("keys", "revoke", key_id)
    assert again.returncode == 1
    assert again.stderr.strip() == (f"tidegate: no API key with id {key_id} "
                                    "(see `tidegate keys list`)")


def test_empty_listings(cli: Cli) -> None:
    assert "no API keys" in cli.ok("keys", "list")
    assert "no policies" in cli.ok("policy", "list")
    assert cli.json("keys", "list") == []
    assert cli.json("policy", "list") == []


# --------------------------------------------------------------------------
# policy
# --------------------------------------------------------------------------


def test_policy_set_list_delete(cli: Cli) -> None:
    out = cli.ok("policy", "set", "--tenant", "acme", "--tpm", "100000")
    assert out.strip() == ("set policy for tenant 'acme': rpm unlimited, tpm 100000, "
                           "concurrency unlimited")
    cli.ok("policy", "set", "--tenant", "acme", "--model", "sim", "--rpm", "60")
    cli.ok("policy", "set", "--tenant", "acme", "--user", "alice", "--concurrency", "2")
    cli.ok("policy", "set", "--model", "meta/llama", "--rpm", "10", "--tpm", "5000")
    listed = cli.json("policy", "list")
    assert listed == [
        {"tenant": "", "model": "meta/llama", "user": "", "rpm": 10, "tpm": 5000,
         "concurrency": 0},
        {"tenant": "acme", "model": "", "user": "", "rpm": 0, "tpm": 100000, "concurrency": 0},
        {"tenant": "acme", "model": "", "user": "alice", "rpm": 0, "tpm": 0, "concurrency": 2},
        {"tenant": "acme", "model": "tidegate-sim", "user": "", "rpm": 60, "tpm": 0,
         "concurrency": 0},
    ]
    rows = [line.split() for line in cli.ok("policy", "list").splitlines()]
    assert rows[0] == ["TENANT", "MODEL", "USER", "RPM", "TPM", "CONCURRENCY"]
    assert ["acme", "*", "alice", "-", "-", "2"] in rows

    # set replaces the policy at its scope
    cli.ok("policy", "set", "--tenant", "acme", "--rpm", "5")
    assert {"tenant": "acme", "model": "", "user": "", "rpm": 5, "tpm": 0,
            "concurrency": 0} in cli.json("policy", "list")

    out = cli.ok("policy", "delete", "--tenant", "acme", "--model", "sim")
    assert out.strip() == "deleted policy for tenant 'acme' x model 'tidegate-sim'"
    assert len(cli.json("policy", "list")) == 3
    missing = cli("policy", "delete", "--tenant", "acme", "--model", "sim")
    assert missing.returncode == 1
    assert "no policy for tenant 'acme' x model 'tidegate-sim'" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_a_tenants_tier_is_set_listed_and_checked_against_the_config(
        cli: Cli, tmp_path: Path) -> None:
    """``tenant set --tier`` names one of the config's [[tiers]] (queue mode's
    weights, docs/queue-mode.md); any other name is one line, no traceback."""
    config = tmp_path / "tiers.toml"
    config.write_text('[[tiers]]\nname = "paid"\nweight = 4.0\n')
    out = cli.ok("tenant", "set", "acme", "--tier", "paid", "--config", str(config))
    assert out.strip() == "set tenant acme: resumable off, tier paid"
    bad = cli("tenant", "set", "acme", "--tier", "gold", "--config", str(config))
    assert bad.returncode != 0
    assert "Traceback" not in bad.stderr
    assert "tier must name one of the config's [[tiers]] (paid), got 'gold'" in bad.stderr
    assert cli.json("tenant", "list", "--config", str(config)) == [
        {"tenant": "acme", "resumable": False, "grace": None, "tier": "paid"}]
    assert "paid" in cli.ok("tenant", "list", "--config", str(config))


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "message"), [
    (["keys"], "required: ACTION"),
    (["keys", "create"], "required: --tenant"),
    (["keys", "create", "--tenant", " "], "--tenant: must not be empty"),
    (["keys", "create", "--tenant", "a", "--models", "a,,b"], "comma-separated model names"),
    (["keys", "create", "--tenant", "a", "--models", ""], "comma-separated model names"),
    (["keys", "revoke"], "required: KEY_ID"),
    (["keys", "revoke", "nothex!nothex"], "12 hex characters"),
    (["keys", "revoke", "abc"], "12 hex characters"),
    (["policy", "set", "--tenant", "acme"], "at least one limit"),
    (["policy", "set", "--tenant", "acme", "--rpm", "0"], "every limit given is 0"),
    (["policy", "set", "--tenant", "acme", "--rpm", "-1"], "--rpm: must be >= 0"),
    (["policy", "set", "--tenant", "acme", "--tpm", "lots"], "--tpm: expected a whole number"),
    (["policy", "set", "--rpm", "1"], "needs a tenant, a model or both"),
    (["policy", "set", "--user", "bob", "--rpm", "1"], "user policy needs its tenant"),
    (["policy", "set", "--model", "m", "--user", "bob", "--rpm", "1"], "needs its tenant"),
    (["policy", "set", "--tenant", "", "--rpm", "1"], "--tenant: must not be empty"),
    (["policy", "delete"], "needs a tenant, a model or both"),
    (["policy", "delete", "--user", "bob"], "needs its tenant"),
    (["policy", "bogus"], "invalid choice"),
    # A control character would print raw into listings and terminals.
    (["keys", "create", "--tenant", "ac\x1b[2Jme"], "--tenant: must be printable"),
    (["keys", "create", "--tenant", "a", "--user", "b\rob"], "--user: must be printable"),
    (["policy", "set", "--tenant", "a\x07", "--rpm", "1"], "--tenant: must be printable"),
    (["usage", "--tenant", "a\x1b"], "--tenant: must be printable"),
])
def test_bad_input_exits_2_before_connecting(args: list[str], message: str) -> None:
    result = run_cli(*args, env={"TIDEGATE_NATS_URL": UNREACHABLE})
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "cannot reach NATS" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("args", [
    ["keys", "list"], ["keys", "create", "--tenant", "a"], ["keys", "revoke", "0" * 12],
    ["policy", "list"], ["policy", "set", "--tenant", "a", "--rpm", "1"],
    ["policy", "delete", "--tenant", "a"],
])
def test_unreachable_nats_is_a_clear_error(args: list[str]) -> None:
    result = run_cli(*args, "--nats-url", UNREACHABLE)
    assert result.returncode == 1
    assert result.stderr.startswith(f"tidegate: cannot reach NATS at {UNREACHABLE}: ")
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


class Listener:
    """A TCP port that counts the connections it accepts and either never
    says a word (``close=False``) or hangs up at once. A command that retried
    would connect again: the count shows it however slow the machine is."""

    def __init__(self, close: bool) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"nats://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self.held: list[socket.socket] = []
        self.close = close
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.close:
                conn.close()
            else:
                self.held.append(conn)

    def stop(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture
def silent_server() -> Iterator[Listener]:
    listener = Listener(close=False)
    yield listener
    listener.stop()


def test_silent_server_times_out_once(silent_server: Listener) -> None:
    result = run_cli("keys", "list", "--nats-url", silent_server.url,
                     env={"TIDEGATE__NATS__CONNECT_TIMEOUT": "1"})
    assert result.returncode == 1
    assert f"cannot reach NATS at {silent_server.url}: no answer within 1s" in result.stderr
    assert "Traceback" not in result.stderr
    assert silent_server.accepted == 1  # the 1 s timeout once, not a retry loop


def test_a_server_that_hangs_up_is_tried_once() -> None:
    listener = Listener(close=True)
    try:
        result = run_cli("keys", "list", "--nats-url", listener.url)
    finally:
        listener.stop()
    assert result.returncode == 1
    assert result.stderr.startswith(f"tidegate: cannot reach NATS at {listener.url}: ")
    assert "Traceback" not in result.stderr
    assert listener.accepted == 1


@pytest.fixture
def nats_without_jetstream(tmp_path: Path) -> Iterator[str]:
    try:
        binary = find_nats_server()
    except Exception as exc:
        pytest.skip(f"no local nats-server binary: {exc}")
    port = free_port()

    def ready() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        except OSError:
            return False
        return True

    server = ManagedProcess("nats-no-js", [binary, "-a", "127.0.0.1", "-p", str(port)],
                            tmp_path / "nats.log", ready=ready)
    server.start()
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.mark.pipeline
def test_nats_without_jetstream_is_a_clear_error(nats_without_jetstream: str) -> None:
    result = run_cli("policy", "list", "--nats-url", nats_without_jetstream)
    assert result.returncode == 1
    assert "JetStream is not enabled" in result.stderr
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------
# End to end: the CLI changes what a running edge accepts, within a second
# --------------------------------------------------------------------------


@pytest.fixture
def pipeline(tmp_path: Path, module_nats_url: str, module_redis_url: str) -> Iterator[Pipeline]:
    yield from running_pipeline(tmp_path / "pipeline", module_nats_url, module_redis_url)


def get_status(url: str, key: str) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return err.code


def within(seconds: float, check: Callable[[], bool]) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > seconds:
            pytest.fail(f"not within {seconds}s")
        time.sleep(0.02)
    return time.monotonic() - start


@pytest.mark.pipeline
def test_cli_key_applies_at_a_running_edge_without_a_restart(pipeline: Pipeline) -> None:
    config = ("--config", str(pipeline.config_path))
    created = json.loads(run_cli("keys", "create", "--tenant", "acme", "--json",
                                 *config).stdout)
    key = created["key"]
    models_url = f"{pipeline.base_url}/models"
    within(30.0, lambda: get_status(models_url, key) == 200)  # ~0.1 s on a quiet box
    status, body = pipeline.post("/v1/chat/completions", {
        "model": "sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        key=key)
    assert status == 200, body

    revoked = run_cli("keys", "revoke", created["key_id"], *config)
    assert revoked.returncode == 0, revoked.stderr
    within(30.0, lambda: get_status(models_url, key) == 401)
    status, body = pipeline.post("/v1/chat/completions", {
        "model": "sim", "messages": [{"role": "user", "content": "hi"}]}, key=key)
    assert status == 401
    assert json.loads(body)["error"]["code"] == "invalid_api_key"


def test_names_print_as_text_and_csv_cells_never_as_formulas() -> None:
    """Names stored before the check (or by other tools) print escaped; a
    name a spreadsheet would evaluate is quoted in CSV output."""
    import contextlib
    import io

    from tidegate.control.admin import UsageError as Usage
    from tidegate.control.admin import check_name, csv_safe, print_table

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_table(["TENANT"], [["ac\x1b[31mme"]])
    assert "\x1b" not in out.getvalue()
    assert "ac\\x1b[31mme" in out.getvalue()
    assert [csv_safe(v) for v in ("=HYPERLINK(1)", "+1", "-1", "@a", "\tx", "acme")] == [
        "'=HYPERLINK(1)", "'+1", "'-1", "'@a", "'\tx", "acme"]
    for bad in ("", " ", "a\x00", "x" * 257, 5):
        with pytest.raises(Usage):
            check_name("tenant", bad)
    assert check_name("tenant", "acme corp") == "acme corp"
