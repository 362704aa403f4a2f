"""NATS permissions per tier: the one access table, derived from tidegate.wire.subjects.

Every tier connects as its own NATS user (``edge``, ``dispatcher``, ``worker``,
``admin``) with its own inbox prefix. :func:`access` is the table (tier -> the
JetStream API subjects, publishes and subscribes it uses); :func:`server_config`
turns it into nats-server's ``authorization`` block.

Invariants: everything is an allow list, the JetStream API included; only
admin creates, updates or deletes streams, consumers and buckets; reading is
a grant of its own (ephemeral ordered consumers only). A new subject, stream
or bucket gets its line in :func:`access` and nowhere else:
``tests/test_nats_walk.py`` walks ``$JS.API.>`` with each tier's credentials
and fails on anything the table does not name. Docs: docs/security.md.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from tidegate.wire import streamlog
from tidegate.wire.subjects import Subjects

#: The edge id the dispatcher's batch runner reads its lines' output under
#: (dispatcher/batch/state.py INBOX; tests/test_nats_permissions.py checks they agree).
BATCH_INBOX = "batch"

ROLES = ("edge", "dispatcher", "worker", "admin")


def inbox_prefix(role: str, edge_id: str = "") -> str:
    """The inbox prefix of ``role``'s connections (nats-py ``inbox_prefix``);
    an edge with its own login has its own, under the edges'."""
    return f"_INBOX_{role}.{edge_id}" if edge_id else f"_INBOX_{role}"


def edge_login(edge_id: str) -> str:
    """The credentials name (``nats.credentials``' ``{tier}``) of one edge's own login."""
    return f"edge.{edge_id}"


def role_of(client_name: str) -> str:
    """The role a connection named ``tidegate-<tier>-...`` plays; anything
    else (CLI, status, bench) is admin."""
    parts = client_name.split("-")
    tier = parts[1] if len(parts) > 1 and parts[0] == "tidegate" else ""
    return tier if tier in ROLES else "admin"


@dataclass(frozen=True, slots=True)
class Rules:
    """One role's permissions, in nats-server's terms."""

    publish_allow: tuple[str, ...]
    publish_deny: tuple[str, ...] = ()
    subscribe_allow: tuple[str, ...] = ()
    subscribe_deny: tuple[str, ...] = ()

    def as_config(self) -> dict[str, dict[str, list[str]]]:
        def part(allow: tuple[str, ...], deny: tuple[str, ...]) -> dict[str, list[str]]:
            out = {"allow": list(allow)}
            if deny:
                out["deny"] = list(deny)
            return out

        return {"publish": part(self.publish_allow, self.publish_deny),
                "subscribe": part(self.subscribe_allow, self.subscribe_deny)}


API = "$JS.API."

# JetStream API verbs that change or destroy streams, consumers and buckets
# (a KV bucket or object store is a stream): admin only, whatever the table
# says. The walk (tests/test_nats_walk.py) checks every tier against
# this list too, so a table line that grants one fails even if it matches the
# server. CONSUMER.CREATE.<stream> (no name) is not here: on that subject the
# server refuses a durable, so it only makes ephemeral readers (KV watches).
ADMIN_VERBS = ("STREAM.CREATE.", "STREAM.UPDATE.", "STREAM.DELETE.", "STREAM.SNAPSHOT.",
               "STREAM.RESTORE.", "STREAM.MSG.DELETE.", "STREAM.LEADER.STEPDOWN.",
               "STREAM.PEER.REMOVE.", "CONSUMER.DURABLE.CREATE.", "CONSUMER.DELETE.",
               "CONSUMER.PAUSE.", "CONSUMER.UNPIN.", "CONSUMER.RESET.",
               "CONSUMER.LEADER.STEPDOWN.", "META.", "SERVER.", "ACCOUNT.")


def is_admin_verb(api: str) -> bool:
    """True for an API subject (relative to ``$JS.API.``) only admin may use:
    the verbs above, and the named form of CONSUMER.CREATE (which creates or
    updates durables)."""
    if api.startswith(ADMIN_VERBS):
        return True
    parts = api.split(".")
    return parts[:2] == ["CONSUMER", "CREATE"] and len(parts) > 3


@dataclass(frozen=True, slots=True)
class Access:
    """One tier's line in the ACCESS table.

    ``api``: the JetStream API subjects it may call, relative to ``$JS.API.``
    (``STREAM.INFO.TG_JOBS``, ``CONSUMER.MSG.NEXT.TG_JOBS.*``, ...);
    ``publish``: every other subject it may publish to (its messages, KV and
    object-store writes, acks, flow-control replies); ``subscribe``: what it
    may subscribe to.
    """

    api: tuple[str, ...]
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]

    def rules(self) -> Rules:
        return Rules(publish_allow=(*(API + a for a in self.api), *self.publish),
                     subscribe_allow=self.subscribe)


class _Grants:
    """Builds one :class:`Access` from the kinds of use a tier makes of JetStream."""

    def __init__(self) -> None:
        self.api: list[str] = []
        self.publish: list[str] = []

    def _add(self, api: tuple[str, ...] = (), publish: tuple[str, ...] = ()) -> _Grants:
        self.api += [a for a in api if a not in self.api]
        self.publish += [p for p in publish if p not in self.publish]
        return self

    def bind(self, *streams: str) -> _Grants:
        """Look a stream or bucket up (``js.stream_info``, ``js.key_value``)."""
        return self._add(tuple(f"STREAM.INFO.{s}" for s in streams))

    def pull(self, stream: str, consumer: str) -> _Grants:
        """Pull from (and ack on) an existing durable consumer."""
        return self.bind(stream)._add(
            (f"CONSUMER.INFO.{stream}.{consumer}", f"CONSUMER.MSG.NEXT.{stream}.{consumer}"),
            (f"$JS.ACK.{stream}.{consumer}.>",))

    def get(self, stream: str) -> _Grants:
        """Read messages by sequence or subject (direct or not)."""
        return self.bind(stream)._add(
            (f"STREAM.MSG.GET.{stream}", f"DIRECT.GET.{stream}", f"DIRECT.GET.{stream}.>"))

    def read(self, stream: str) -> _Grants:
        """:meth:`get`, and follow with an ephemeral ordered consumer (a KV
        watch, the log reader). The no-name CONSUMER.CREATE subject only makes
        ephemerals, which the server drops once idle; no delete is needed or
        granted. (A push consumer's deliver subject is not checked, see the
        known gap above: only grant this where the tier must follow.)"""
        return self.get(stream)._add(
            (f"CONSUMER.CREATE.{stream}", f"CONSUMER.INFO.{stream}.*"),
            (f"$JS.FC.{stream}.>",))

    def watch(self, bucket: str) -> _Grants:
        """Read a KV bucket (get, keys, watch)."""
        return self.read(_kv(bucket))

    def write(self, bucket: str) -> _Grants:
        """Put, update and delete keys of a KV bucket (a publish each)."""
        return self.bind(_kv(bucket))._add(publish=(f"$KV.{bucket}.>",))

    def objects(self, bucket: str) -> _Grants:
        """Read and write an object store: direct gets chunk by chunk
        (tidegate.broker.objects), no consumer; deleting an object is a purge
        of its chunk and meta subjects (the object-store format's own delete)."""
        stream = f"OBJ_{bucket}"
        return self.get(stream)._add((f"STREAM.PURGE.{stream}",), (f"$O.{bucket}.>",))

    def chunks(self, bucket: str) -> _Grants:
        """Read an object store and publish chunks to it, nothing else: no
        object exists until a tier with :meth:`objects` seals it (its meta),
        and nothing is purged (tidegate.control.desk)."""
        stream = f"OBJ_{bucket}"
        return self.get(stream)._add(publish=(f"$O.{bucket}.C.>",))

    def messages(self, *subjects: str) -> _Grants:
        """Core or JetStream publishes (a JetStream publish is a plain publish
        whose ack the server sends to the publisher's inbox)."""
        return self._add(publish=subjects)

    def done(self, subscribe: tuple[str, ...]) -> Access:
        return Access(tuple(self.api), tuple(self.publish), subscribe)


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def access(subjects: Subjects) -> dict[str, Access]:
    """THE ACCESS TABLE: tier -> exactly what its credentials may do.

    Admin (``tidegate setup``, the CLI) may do anything; it is not a tier.
    Every stream, consumer and bucket here is created by admin
    (tidegate.control.provision) before the tiers run.
    """
    p, s = subjects.prefix, subjects
    P = p.upper()
    requests, jobs, usage = s.requests_stream, s.jobs_stream, s.usage_stream
    log = streamlog.stream_name(s)
    files, filemeta, batches, batchout = f"{P}_FILES", f"{P}_FILEMETA", f"{P}_BATCHES", \
        f"{P}_BATCHOUT"
    keyuse, tenants, edges = f"{P}_KEYUSE", f"{P}_TENANTS", f"{P}_EDGES"
    prices, budgets = f"{P}_PRICES", f"{P}_BUDGETS"  # docs/spend.md
    bodies = s.bodies_bucket  # claimed request bodies (tidegate.broker.bodies)

    def inbox(role: str) -> str:
        return f"{inbox_prefix(role)}.>"

    streams = (requests, jobs, usage, log)
    edge = (_Grants().bind(*streams)
            # No usage subject: workers report usage, an edge never does, and a
            # record forged with stolen edge credentials would bill a tenant.
            .messages(s.requests_wildcard, f"{p}.ctl.*", s.desk,
                      streamlog.wildcard(s), streamlog.edge_cancel_subject(s),
                      # -NAK of a job whose worker it found dead (tidegate.broker.liveness):
                      # another worker runs it at once, not after ack_wait.
                      f"$JS.ACK.{jobs}.>")
            .watch(s.keys_bucket).write(keyuse).watch(tenants)
            .write(s.cancels_bucket).write(edges)
            .read(log)  # resume and background responses read the log
            # Files and batches read, uploads' chunks published; their records
            # and deletions are a dispatcher's, for the key the edge passes on
            # (tidegate.control.desk): stolen edge credentials give away, forge
            # and delete nothing.
            .chunks(files).watch(filemeta).watch(batches)
            .bind(_kv(batchout))
            .objects(bodies)  # stores a body too large for a message
            .done((inbox("edge"), f"{p}.out.*.*", streamlog.edge_cancel_subject(s))))
    dispatcher = (_Grants().bind(*streams)
                  .pull(requests, s.dispatcher_consumer).pull(usage, "reconcilers")
                  .messages(s.jobs_wildcard, f"{p}.out.*.*", f"{p}.usage.>", f"{p}.ctl.*",
                            s.requests_wildcard, f"{p}.grant.*", s.preempt_wildcard,
                            # -NAK of a batch line's job whose worker the runner
                            # found dead (tidegate.broker.liveness), as the edge does.
                            f"$JS.ACK.{jobs}.>")
                  # Queue depth per model (gate, batch release, queue stats).
                  ._add((f"CONSUMER.INFO.{jobs}.*", f"CONSUMER.INFO.{requests}.*",
                         f"STREAM.MSG.GET.{jobs}"))
                  .watch(s.policies_bucket).watch(prices).watch(budgets)
                  # Read only: per-key rules re-checked for batch lines; the
                  # tenants' tiers (queue mode's weights).
                  .watch(s.keys_bucket).watch(tenants)
                  .watch(s.cancels_bucket).write(s.cancels_bucket)  # a batch's cancels
                  .watch(s.workers_bucket)
                  # Follows the homes workers write; reads a claim (routing's fallback).
                  .watch(s.affinity_bucket).get(_kv(s.claims_bucket))
                  .objects(files).watch(filemeta).write(filemeta)
                  .watch(batches).write(batches).watch(batchout).write(batchout)
                  # Reads a claimed body (admission, routing); stores a batch
                  # line's too large for a message (dispatcher.batch.release).
                  .objects(bodies)
                  # The desk's answers, to the asking edge's inbox.
                  .messages(inbox("edge"))
                  .done((inbox("dispatcher"), s.load_wildcard, s.edge_inbox(BATCH_INBOX),
                         f"{p}.grant.*", s.desk)))
    worker = (_Grants().bind(*streams)
              .pull(jobs, "*")  # one durable per model (and per replica)
              # A redelivered resumable job reads its log for output of the
              # dead attempt (workers.resumable).
              .get(log)
              .messages(f"{p}.out.>", s.usage_wildcard, s.load_wildcard,
                        streamlog.wildcard(s),
                        # A redelivered job no edge spoke for asks its first
                        # worker whether it still runs it (workers.resumable):
                        # presence, which commands nothing; the answer goes to
                        # the asking worker's inbox.
                        f"{p}.live.*", inbox("worker"))
              .watch(s.cancels_bucket)
              .write(s.workers_bucket)
              .watch(prices)  # each job is costed at its model's price
              # Who owns each Responses API response (workers.owners).
              .get(_kv(s.responses_bucket)).write(s.responses_bucket)
              # Writes a conversation's home; claims a routed job's copy (a
              # create, then a get when another copy was first: workers.routing).
              .write(s.affinity_bucket).get(_kv(s.claims_bucket)).write(s.claims_bucket)
              .objects(bodies)  # reads a claimed body, deletes it once the job is done
              # Asked to hand back a background response (workers.preemption).
              .done((inbox("worker"), f"{p}.ctl.*", f"{p}.live.*", s.preempt_wildcard)))
    return {"edge": edge, "dispatcher": dispatcher, "worker": worker}


def edge_access(subjects: Subjects, edge_id: str) -> Access:
    """One edge's own line: the edges' grants, but it reads only its own
    replies (``<p>.out.<edge_id>.*``) and inbox, never another edge's."""
    shared = access(subjects)["edge"]
    own = {f"{inbox_prefix('edge')}.>": f"{inbox_prefix('edge', edge_id)}.>",
           f"{subjects.prefix}.out.*.*": subjects.edge_inbox(edge_id)}
    return Access(shared.api, shared.publish,
                  tuple(own.get(subject, subject) for subject in shared.subscribe))


def table(subjects: Subjects) -> dict[str, Rules]:
    """Role -> its nats-server rules, for the subjects of one prefix."""
    rules = {role: line.rules() for role, line in access(subjects).items()}
    rules["admin"] = Rules(publish_allow=(">",), subscribe_allow=(">",))
    return rules


@dataclass(frozen=True, slots=True)
class Credentials:
    """One role's NATS login."""

    role: str
    user: str
    password: str = field(repr=False)
    edge_id: str = ""  # one edge's own login (edge_login), else the tier's

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.role, self.edge_id)

    @property
    def name(self) -> str:
        """Its name in ``nats.credentials``' ``{tier}``."""
        return edge_login(self.edge_id) if self.edge_id else self.role

    def to_toml(self) -> str:
        whose = f"edge {self.edge_id}" if self.edge_id else f"{self.role} tier"
        return (f'# tidegate NATS credentials for the {whose} (keep private)\n'
                f'user = "{self.user}"\npassword = "{self.password}"\n'
                f'inbox_prefix = "{self.inbox_prefix}"\n')


def new_credentials(edge_ids: tuple[str, ...] = ()) -> dict[str, Credentials]:
    """Fresh random passwords (192 bits) by credentials name: every role's,
    or, given ``edge_ids``, one login per edge instead of the edges' shared one."""
    def password() -> str:
        return secrets.token_urlsafe(24)

    out = {role: Credentials(role, f"tidegate-{role}", password()) for role in ROLES
           if not (edge_ids and role == "edge")}
    for edge_id in edge_ids:
        c = Credentials("edge", f"tidegate-edge-{edge_id}", password(), edge_id)
        out[c.name] = c
    return out


def server_config(subjects: Subjects, creds: dict[str, Credentials]) -> str:
    """nats-server's ``authorization`` block for these roles and logins.

    No ``no_auth_user``: a connection without credentials is refused.
    """
    rules = table(subjects)
    users = []
    for c in creds.values():
        role_rules = edge_access(subjects, c.edge_id).rules() if c.edge_id else rules[c.role]
        users.append({"user": c.user, "password": c.password,
                      "permissions": role_rules.as_config()})
    # nats-server's config format accepts JSON syntax.
    return ("# Written by `tidegate nats-config`: one user per tidegate tier.\n"
            "# Permissions: tidegate/broker/permissions.py, docs/security.md.\n"
            "authorization " + json.dumps({"users": users}, indent=2) + "\n")
