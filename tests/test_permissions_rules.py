"""The NATS access table and the files made from it, without a server
(tidegate.broker.permissions).

Each tier's rules are matched, as nats-server matches them, against the
concrete subjects its code sends (nats-py's JetStream API calls, its messages,
acks and KV and object-store writes) and against what it must never send, for
a deployment with its own prefix; then the ``authorization`` block, the
logins and one edge's own line. The same rules against a real nats-server:
tests/test_nats_permissions.py and tests/test_nats_walk.py.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from dispatcher.batch.state import INBOX as BATCH_RUNNER
from tidegate import config as tgconfig
from tidegate.broker.permissions import (
    ADMIN_VERBS,
    ROLES,
    Credentials,
    Rules,
    access,
    edge_access,
    is_admin_verb,
    new_credentials,
    role_of,
    server_config,
    table,
)
from tidegate.control import batches, budgets, edges_registry, keys, prices, provision, tenants
from tidegate.wire import streamlog
from tidegate.wire.subjects import Subjects, encode_token

MODEL = "acme-model"
RID = "a" * 24


def allows(patterns: tuple[str, ...], subject: str) -> bool:
    """nats-server's subject matching: ``*`` is one token, ``>`` one or more."""
    have = subject.split(".")
    for pattern in patterns:
        want = pattern.split(".")
        for i, token in enumerate(want):
            if token == ">":
                if len(have) > i:
                    return True
                break
            if i >= len(have) or token not in ("*", have[i]):
                break
        else:
            if len(want) == len(have):
                return True
    return False


# What nats-py sends for each kind of use (nats/js/manager.py, client.py).

def bind(stream: str) -> list[str]:
    return [f"$JS.API.STREAM.INFO.{stream}"]


def get(stream: str, subject: str) -> list[str]:
    return [*bind(stream), f"$JS.API.STREAM.MSG.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}.{subject}"]


def follow(stream: str, subject: str) -> list[str]:
    """A KV watch or an ordered consumer: an ephemeral, its info, flow control."""
    return [*get(stream, subject), f"$JS.API.CONSUMER.CREATE.{stream}",
            f"$JS.API.CONSUMER.INFO.{stream}.eph1", f"$JS.FC.{stream}.eph1.1"]


def kv_read(bucket: str) -> list[str]:
    return follow(f"KV_{bucket}", f"$KV.{bucket}.key")


def kv_get(bucket: str) -> list[str]:
    return get(f"KV_{bucket}", f"$KV.{bucket}.key")


def kv_write(bucket: str) -> list[str]:
    return [*bind(f"KV_{bucket}"), f"$KV.{bucket}.key"]


def pull(stream: str, consumer: str) -> list[str]:
    return [*bind(stream), f"$JS.API.CONSUMER.INFO.{stream}.{consumer}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"$JS.ACK.{stream}.{consumer}.1.7.3.1700000000000000000.0"]


def chunks(bucket: str) -> list[str]:
    return [*get(f"OBJ_{bucket}", f"$O.{bucket}.C.nuid"), f"$O.{bucket}.C.nuid"]


def objects(bucket: str) -> list[str]:
    """Put, get and delete objects: chunks, the meta that names them, a purge."""
    return [*chunks(bucket), f"$O.{bucket}.M.bmFtZQ==", f"$JS.API.STREAM.PURGE.OBJ_{bucket}"]


def deployment() -> tuple[Subjects, dict[str, str]]:
    """A prefix of its own, and the product's names for its buckets."""
    config = tgconfig.from_dict({"nats": {"subject_prefix": "acme"},
                                 "models": [{"name": MODEL}]})
    files, filemeta, batch, batchout = batches.bucket_names(config)
    return config.nats.subjects, {
        "files": files, "filemeta": filemeta, "batches": batch, "batchout": batchout,
        "keyuse": keys.last_used_bucket(config), "tenants": tenants.bucket_name(config),
        "edges": edges_registry.bucket_name(config), "prices": prices.bucket_name(config),
        "budgets": budgets.bucket_name(config)}


def needs(role: str) -> tuple[list[str], list[str]]:
    """(publishes, subscribes) that ``role``'s code makes."""
    s, b = deployment()
    log = streamlog.stream_name(s)
    jobs_ack = pull(s.jobs_stream, s.worker_consumer(MODEL))[-1]  # a -NAK of a dead job
    streams = [a for stream in (s.requests_stream, s.jobs_stream, s.usage_stream, log)
               for a in bind(stream)]
    grant = f"{s.prefix}.grant.{encode_token('dispatcher-1')}"
    if role == "edge":
        return [*streams, s.request("interactive", "tenant"), s.control("w1"),
                s.retransmit_any, s.desk, streamlog.subject(s, RID),
                streamlog.edge_cancel_subject(s), jobs_ack,
                *kv_read(s.keys_bucket), *kv_write(b["keyuse"]), *kv_read(b["tenants"]),
                *kv_write(s.cancels_bucket), s.cancel_key(RID), *kv_write(b["edges"]),
                *follow(log, streamlog.subject(s, RID)),
                *chunks(b["files"]), *kv_read(b["filemeta"]), *kv_read(b["batches"]),
                *bind(f"KV_{b['batchout']}"), *objects(s.bodies_bucket)], \
            ["_INBOX_edge.x1", s.out("edge-1", RID), streamlog.edge_cancel_subject(s)]
    if role == "dispatcher":
        return [*streams, *pull(s.requests_stream, s.dispatcher_consumer),
                *pull(s.usage_stream, provision.RECONCILERS),
                s.job(MODEL), s.job_replica(MODEL, "r1"), s.out("edge-1", RID),
                s.usage(MODEL), s.control("w1"), s.request("batch", "tenant"), grant,
                s.preempt(MODEL), jobs_ack,
                f"$JS.API.CONSUMER.INFO.{s.jobs_stream}.{s.worker_consumer(MODEL)}",
                f"$JS.API.CONSUMER.INFO.{s.requests_stream}.{s.dispatcher_consumer}",
                f"$JS.API.STREAM.MSG.GET.{s.jobs_stream}",
                *kv_read(s.policies_bucket), *kv_read(b["prices"]), *kv_read(b["budgets"]),
                *kv_read(s.keys_bucket), *kv_read(b["tenants"]),
                *kv_read(s.cancels_bucket), s.cancel_key(RID), *kv_read(s.workers_bucket),
                *kv_read(s.affinity_bucket), *kv_get(s.claims_bucket),
                *objects(b["files"]), *kv_read(b["filemeta"]), *kv_write(b["filemeta"]),
                *kv_read(b["batches"]), *kv_write(b["batches"]),
                *kv_read(b["batchout"]), *kv_write(b["batchout"]),
                *objects(s.bodies_bucket), "_INBOX_edge.x1"], \
            ["_INBOX_dispatcher.x1", s.load(MODEL), s.out(BATCH_RUNNER, RID), grant, s.desk]
    return [*streams, *pull(s.jobs_stream, s.worker_consumer(MODEL)),
            *pull(s.jobs_stream, s.replica_consumer(MODEL, "r1")),
            *get(log, streamlog.subject(s, RID)),
            s.out("edge-1", RID), s.edge_mux("edge-1"), s.usage(MODEL), s.load(MODEL),
            streamlog.subject(s, RID), s.presence("w2"), "_INBOX_worker.x1",
            *kv_read(s.cancels_bucket), *kv_write(s.workers_bucket), *kv_read(b["prices"]),
            *kv_get(s.responses_bucket), *kv_write(s.responses_bucket),
            *kv_write(s.affinity_bucket), *kv_get(s.claims_bucket),
            *kv_write(s.claims_bucket), *objects(s.bodies_bucket)], \
        ["_INBOX_worker.x1", s.control("w1"), s.presence("w1"), s.preempt(MODEL)]


def must_not(role: str) -> tuple[list[str], list[str]]:
    """(publishes, subscribes) a stolen login of ``role`` must be refused."""
    s, b = deployment()
    admin = [f"$JS.API.STREAM.DELETE.{s.jobs_stream}", "$JS.API.STREAM.CREATE.STEAL",
             f"$JS.API.STREAM.UPDATE.{s.usage_stream}",
             f"$JS.API.CONSUMER.DELETE.{s.jobs_stream}.{s.worker_consumer(MODEL)}",
             f"$JS.API.CONSUMER.CREATE.{s.jobs_stream}.stolen",
             f"$JS.API.CONSUMER.DURABLE.CREATE.KV_{s.keys_bucket}.stolen",
             f"$KV.{s.keys_bucket}.key", f"$KV.{s.policies_bucket}.key",
             f"$JS.API.STREAM.PURGE.KV_{s.keys_bucket}", "_INBOX.x1", "anything"]
    if role == "edge":
        return [*admin, s.out("edge-2", RID), s.edge_mux("edge-1"), s.usage(MODEL),
                s.job(MODEL), s.preempt(MODEL), "_INBOX_worker.x1",
                f"$JS.API.CONSUMER.MSG.NEXT.{s.jobs_stream}.{s.worker_consumer(MODEL)}",
                f"$JS.API.CONSUMER.CREATE.{s.jobs_stream}",
                *kv_read(s.policies_bucket)[1:], *kv_read(s.workers_bucket)[1:],
                f"$KV.{b['filemeta']}.key", f"$KV.{b['batches']}.key",
                f"$O.{b['files']}.M.bmFtZQ==", f"$JS.API.STREAM.PURGE.OBJ_{b['files']}",
                *kv_get(b["batchout"])[1:]], \
            [s.requests_wildcard, "_INBOX_dispatcher.x1", "_INBOX.x1", s.preempt(MODEL),
             s.load(MODEL)]
    if role == "dispatcher":
        return [*admin, f"$KV.{s.claims_bucket}.key", f"$KV.{s.affinity_bucket}.key",
                f"$KV.{s.workers_bucket}.key", s.presence("w1"),
                f"$JS.API.CONSUMER.MSG.NEXT.{s.jobs_stream}.{s.worker_consumer(MODEL)}",
                f"$JS.API.DIRECT.GET.{s.jobs_stream}"], \
            ["_INBOX_worker.x1", "_INBOX_edge.x1", s.out("edge-1", RID), s.requests_wildcard]
    return [*admin, s.request("interactive", "tenant"), s.control("w1"), s.preempt(MODEL),
            s.desk, f"$KV.{s.cancels_bucket}.key",
            f"$JS.API.CONSUMER.MSG.NEXT.{s.requests_stream}.{s.dispatcher_consumer}",
            *kv_read(s.keys_bucket)[1:], *kv_read(s.claims_bucket)[-3:],
            *kv_read(s.affinity_bucket)[1:], f"$JS.API.DIRECT.GET.{s.usage_stream}"], \
        [f"{s.prefix}.out.>", "_INBOX_edge.x1", "_INBOX_dispatcher.x1", s.desk]


@pytest.mark.parametrize("role", ["edge", "dispatcher", "worker"])
def test_each_tier_may_send_and_hear_what_its_code_does(role: str) -> None:
    rules = table(deployment()[0])[role]
    publishes, subscribes = needs(role)
    assert [p for p in publishes if not allows(rules.publish_allow, p)] == []
    assert [s for s in subscribes if not allows(rules.subscribe_allow, s)] == []


@pytest.mark.parametrize("role", ["edge", "dispatcher", "worker"])
def test_a_stolen_tier_login_is_refused_what_its_role_never_does(role: str) -> None:
    rules = table(deployment()[0])[role]
    publishes, subscribes = must_not(role)
    assert [p for p in publishes if allows(rules.publish_allow, p)] == []
    assert [s for s in subscribes if allows(rules.subscribe_allow, s)] == []


def test_tiers_get_allow_lists_without_admin_verbs_and_admin_gets_all() -> None:
    s = deployment()[0]
    rules, lines = table(s), access(s)
    assert set(rules) == set(ROLES)
    assert set(lines) == set(ROLES) - {"admin"}
    for role, line in lines.items():
        assert [a for a in line.api if is_admin_verb(a)] == [], role
        assert rules[role].publish_allow == (*("$JS.API." + a for a in line.api),
                                             *line.publish)
        assert rules[role].subscribe_allow == line.subscribe
        assert not rules[role].publish_deny
        assert not rules[role].subscribe_deny
    assert allows(rules["admin"].publish_allow, f"$JS.API.STREAM.DELETE.{s.jobs_stream}")
    assert allows(rules["admin"].subscribe_allow, "_INBOX_worker.x1")


def test_every_grant_names_a_stream_or_bucket_that_setup_makes() -> None:
    """A grant on a name nothing provisions is one a later stream of that name
    would inherit."""
    s, b = deployment()
    buckets = {*b.values(), s.keys_bucket, s.policies_bucket, s.cancels_bucket,
               s.workers_bucket, s.affinity_bucket, s.claims_bucket, s.responses_bucket,
               s.bodies_bucket}
    made = {s.requests_stream, s.jobs_stream, s.usage_stream, streamlog.stream_name(s),
            *(f"KV_{x}" for x in buckets), *(f"OBJ_{x}" for x in buckets)}
    for role, line in access(s).items():
        for api in line.api:
            tokens = api.split(".")
            assert tokens[3 if tokens[1] == "MSG" else 2] in made, (role, api)
        for subject in line.publish:
            tokens = subject.split(".")
            if tokens[0] in ("$KV", "$O"):
                assert tokens[1] in buckets, (role, subject)
            elif tokens[0] == "$JS":
                assert tokens[2] in made, (role, subject)


def test_admin_verbs_are_the_changes_and_the_named_consumer_create() -> None:
    for verb in ADMIN_VERBS:
        assert is_admin_verb(verb + "TG_JOBS"), verb
    for api in ("CONSUMER.CREATE.TG_JOBS.workers", "CONSUMER.CREATE.TG_JOBS.workers.tg.job.>"):
        assert is_admin_verb(api), api
    # What tiers use: lookups, reads, pulls, ephemerals (the no-name create).
    for api in ("CONSUMER.CREATE.KV_TG_KEYS", "STREAM.INFO.TG_JOBS", "STREAM.MSG.GET.TG_JOBS",
                "CONSUMER.INFO.TG_JOBS.workers", "CONSUMER.MSG.NEXT.TG_JOBS.workers",
                "DIRECT.GET.KV_TG_KEYS.$KV.TG_KEYS.k", "STREAM.PURGE.OBJ_TG_BODIES"):
        assert not is_admin_verb(api), api


def test_an_edge_login_hears_only_its_own_replies_and_inbox() -> None:
    s = deployment()[0]
    shared, own = access(s)["edge"], edge_access(s, "edge-1")
    assert (own.api, own.publish) == (shared.api, shared.publish)
    for subject in ("_INBOX_edge.edge-1.x1", s.out("edge-1", RID),
                    streamlog.edge_cancel_subject(s)):
        assert allows(own.subscribe, subject), subject
    for subject in ("_INBOX_edge.x1", "_INBOX_edge.edge-2.x1", s.out("edge-2", RID)):
        assert allows(shared.subscribe, subject)
        assert not allows(own.subscribe, subject)
    assert len(own.subscribe) == len(shared.subscribe)


def test_rules_render_as_nats_server_permission_blocks() -> None:
    plain = Rules(publish_allow=("a.>",), subscribe_allow=("b.*", "c"))
    assert plain.as_config() == {"publish": {"allow": ["a.>"]},
                                 "subscribe": {"allow": ["b.*", "c"]}}
    denying = Rules(("a.>",), ("a.x",), ("b.>",), ("b.y", "b.z"))
    assert denying.as_config() == {"publish": {"allow": ["a.>"], "deny": ["a.x"]},
                                   "subscribe": {"allow": ["b.>"], "deny": ["b.y", "b.z"]}}


def parse(conf: str) -> list[dict[str, Any]]:
    """The users of a written config: comment lines, then ``authorization``
    and its block in JSON syntax, nothing after it."""
    lines = conf.splitlines(keepends=True)
    body = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    head, block = "".join(lines[body:]).split(" ", 1)
    assert head == "authorization"
    assert block.endswith("}\n")
    parsed = json.loads(block)
    assert set(parsed) == {"users"}  # no no_auth_user: anonymous connections are refused
    users: list[dict[str, Any]] = parsed["users"]
    return users


def test_the_server_config_has_one_user_per_login_with_its_role_s_rules() -> None:
    s = deployment()[0]
    creds = new_credentials()
    users = parse(server_config(s, creds))
    rules = table(s)
    assert [(u["user"], u["password"]) for u in users] == [(c.user, c.password)
                                                           for c in creds.values()]
    assert [u["permissions"] for u in users] == [rules[c.role].as_config()
                                                for c in creds.values()]
    assert set(users[0]) == {"user", "password", "permissions"}


def test_edge_logins_get_their_own_lines_in_the_server_config() -> None:
    s = deployment()[0]
    creds = new_credentials(("edge-1", "edge-2"))
    by_user = {u["user"]: u["permissions"] for u in parse(server_config(s, creds))}
    for edge_id in ("edge-1", "edge-2"):
        assert by_user[f"tidegate-edge-{edge_id}"] == edge_access(s, edge_id).rules().as_config()
    assert by_user["tidegate-dispatcher"] == table(s)["dispatcher"].as_config()
    one = by_user["tidegate-edge-edge-1"]["subscribe"]["allow"]
    assert s.edge_inbox("edge-1") in one
    assert s.edge_inbox("edge-2") not in one


def _bits(password: str) -> int:
    return 8 * len(base64.urlsafe_b64decode(password + "=" * (-len(password) % 4)))


def test_new_credentials_are_one_random_login_per_role() -> None:
    creds, again = new_credentials(), new_credentials()
    assert list(creds) == list(ROLES)
    for name, c in creds.items():
        assert (c.role, c.user, c.edge_id, c.name) == (name, f"tidegate-{name}", "", name)
        assert c.inbox_prefix == f"_INBOX_{name}"
        assert _bits(c.password) == 192
    passwords = [c.password for c in (*creds.values(), *again.values())]
    assert len(set(passwords)) == len(passwords)
    assert creds["admin"].password not in repr(creds["admin"])


def test_edge_ids_replace_the_shared_edge_login_with_one_per_edge() -> None:
    creds = new_credentials(("edge-1", "edge-2"))
    assert list(creds) == ["dispatcher", "worker", "admin", "edge.edge-1", "edge.edge-2"]
    one = creds["edge.edge-1"]
    assert (one.role, one.user, one.edge_id) == ("edge", "tidegate-edge-edge-1", "edge-1")
    assert one.inbox_prefix == "_INBOX_edge.edge-1"
    assert _bits(one.password) == 192
    assert len({c.password for c in creds.values()}) == len(creds)
    assert 'inbox_prefix = "_INBOX_edge.edge-1"' in one.to_toml()


def test_credentials_round_trip_through_their_toml_which_says_whose_it_is() -> None:
    import tomllib

    c = Credentials("worker", "tidegate-worker", "pw")
    assert tomllib.loads(c.to_toml()) == {"user": "tidegate-worker", "password": "pw",
                                          "inbox_prefix": "_INBOX_worker"}
    # A file copied to another host still says which login it is.
    assert "for the worker tier" in c.to_toml().splitlines()[0]
    edge = Credentials("edge", "tidegate-edge-edge-1", "pw", "edge-1")
    assert "for the edge edge-1" in edge.to_toml().splitlines()[0]


def test_a_connection_s_name_picks_the_login_it_uses() -> None:
    assert role_of("tidegate-dispatcher") == "dispatcher"  # the dispatcher's main connection
    assert role_of("tidegate-edge-edge-1") == "edge"
    assert role_of("tidegate-worker-w1-jobs") == "worker"
    # Tools (CLI, console, bench) are admin, whatever else their name holds.
    for name in ("tidegate", "tidegate-console", "bench-edge-1", "edge-tidegate-worker", ""):
        assert role_of(name) == "admin", name
