"""NATS permissions per tier: the ONE table, derived from tidegate.wire.subjects.

Every tier connects as its own NATS user (``edge``, ``dispatcher``, ``worker``,
``admin``) with its own inbox prefix (``_INBOX_<tier>``), and the server
enforces what each may publish and subscribe to. :func:`table` builds the
rules from a :class:`~tidegate.wire.subjects.Subjects`, so a custom prefix
gets the same rules; :func:`server_config` turns them into nats-server's
``authorization`` block and ``tidegate nats-config`` writes it with one
credentials file per tier (docs/security.md has the table in prose).

How the rules are shaped, and why:

* **Subscribe is an allow list per tier.** A tier may read its own inbox
  (JetStream API replies, KV watches, pull fetches all deliver there) and the
  core subjects its role reads; nothing else. No tier can read another
  tier's replies or, e.g., the ``$KV.<P>_KEYS.>`` puts as they happen.
* **Publish under the tidegate prefix is an allow list per tier** (an edge
  publishes requests, acks and cancels, never ``<p>.out.>``; a worker never
  ``<p>.req.>``).
* **The JetStream API is allowed with a deny list.** The API is one subject
  tree (``$JS.API.>``) whose exact needs change with every feature (streams,
  buckets, object stores, ordered consumers); what matters is denied by name:
  pulling or reading another role's work stream (``CONSUMER.MSG.NEXT``,
  ``CONSUMER.CREATE``, ``STREAM.MSG.GET``, ``DIRECT.GET`` on ``<P>_JOBS`` for
  an edge), reading a bucket the role does not need (``<P>_POLICIES`` for an
  edge, ``<P>_KEYS`` for a worker), and destroying anything (stream delete
  for every tier but admin, purge of the queues, keys, policies and logs).
* **KV writes** (``$KV.<bucket>.>``) are allowed per tier for its own buckets
  and denied for the control buckets of other roles: only admin writes keys
  and policies.

ADDING A FEATURE: a new subject, stream, KV bucket or object store (the resume
log stream, the batch buckets, WebSocket, ...) gets its line here and nowhere
else: add it to the role(s) that publish or read it in :func:`table`, and
extend ``tests/test_nats_permissions.py``, which runs the whole pipeline under
these rules and proves the denials.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field

from tidegate.wire import streamlog
from tidegate.wire.subjects import Subjects

#: The edge id the dispatcher's batch runner reads its lines' output under
#: (dispatcher/batch_state.py INBOX; tests/test_nats_permissions.py checks they agree).
BATCH_INBOX = "batch"

ROLES = ("edge", "dispatcher", "worker", "admin")


def inbox_prefix(role: str) -> str:
    """The inbox prefix of ``role``'s connections (nats-py ``inbox_prefix``)."""
    return f"_INBOX_{role}"


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


def _read_stream(stream: str) -> tuple[str, ...]:
    """The JetStream API subjects that read messages of ``stream``."""
    return (f"$JS.API.CONSUMER.MSG.NEXT.{stream}.>",
            f"$JS.API.CONSUMER.CREATE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}.>",
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"$JS.API.STREAM.MSG.GET.{stream}", f"$JS.API.DIRECT.GET.{stream}",
            f"$JS.API.DIRECT.GET.{stream}.>")


def _kv(bucket: str) -> str:
    return f"KV_{bucket}"


def _destroy(protected: tuple[str, ...]) -> tuple[str, ...]:
    """Deleting any stream, and purging or deleting messages of ``protected``
    ones. (Object stores delete an object with a filtered purge, and batch
    buckets expire entries that way, so purge stays allowed elsewhere.)"""
    return ("$JS.API.STREAM.DELETE.>",
            *(f"$JS.API.STREAM.{verb}.{stream}" for stream in protected
              for verb in ("PURGE", "MSG.DELETE")))


def _change_bucket(bucket: str) -> tuple[str, ...]:
    """Reconfiguring a bucket (e.g. a max age that wipes every key)."""
    return (f"$JS.API.STREAM.UPDATE.{_kv(bucket)}",)


def table(subjects: Subjects) -> dict[str, Rules]:
    """Role -> its rules, for the subjects of one prefix."""
    p, s = subjects.prefix, subjects
    requests, jobs, usage = s.requests_stream, s.jobs_stream, s.usage_stream
    keys, policies, cancels = s.keys_bucket, s.policies_bucket, s.cancels_bucket
    workers, affinity, claims = s.workers_bucket, s.affinity_bucket, s.claims_bucket
    # JetStream plumbing every service tier needs: the API (minus denials),
    # flow-control replies of push/ordered consumers, acks of its pulls.
    js = ("$JS.API.>", "$JS.FC.>")

    # Streams only admin may purge: the work queues, the usage log, keys and
    # policies, the resume log.
    protected = (requests, jobs, usage, _kv(keys), _kv(policies), streamlog.stream_name(s))
    destroy = _destroy(protected)

    def inbox(role: str) -> str:
        return f"{inbox_prefix(role)}.>"

    # Resumable streams (docs/resume.md): workers and edges write the log,
    # edges tell each other to end a stream they hold.
    log, edge_cancel = streamlog.wildcard(s), streamlog.edge_cancel_subject(s)

    edge = Rules(
        publish_allow=(*js, f"{p}.req.>", f"{p}.ctl.*", f"{p}.usage.>", "$KV.>", "$O.>",
                       "$JS.ACK.>", log, edge_cancel),
        publish_deny=(
            *destroy, *_read_stream(jobs), *_read_stream(requests), *_read_stream(usage),
            *_read_stream(_kv(policies)), *_change_bucket(keys), *_change_bucket(policies),
            f"$KV.{keys}.>", f"$KV.{policies}.>", f"$KV.{workers}.>", f"$KV.{affinity}.>",
            f"$KV.{claims}.>", f"{p}.out.>"),
        subscribe_allow=(inbox("edge"), f"{p}.out.*.*", edge_cancel),
    )
    dispatcher = Rules(
        publish_allow=(*js, "$JS.ACK.>", f"{p}.job.>", f"{p}.out.*.*", f"{p}.usage.>",
                       f"{p}.ctl.*", "$KV.>", "$O.>", f"{p}.req.>"),
        publish_deny=(*destroy, *_read_stream(_kv(keys)), *_change_bucket(keys),
                      *_change_bucket(policies), f"$KV.{keys}.>", f"$KV.{policies}.>"),
        subscribe_allow=(inbox("dispatcher"), f"{p}.load.*", s.edge_inbox(BATCH_INBOX)),
    )
    worker = Rules(
        publish_allow=(*js, "$JS.ACK.>", f"{p}.out.>", f"{p}.usage.>", f"{p}.load.*", log,
                       f"$KV.{workers}.>", f"$KV.{affinity}.>", f"$KV.{claims}.>",
                       f"$KV.{cancels}.>"),
        publish_deny=(*destroy, *_read_stream(requests), *_read_stream(_kv(keys)),
                      *_read_stream(_kv(policies)), *_change_bucket(keys),
                      *_change_bucket(policies), f"{p}.req.>", f"$KV.{keys}.>",
                      f"$KV.{policies}.>"),
        subscribe_allow=(inbox("worker"), f"{p}.ctl.*"),
    )
    admin = Rules(publish_allow=(">",), subscribe_allow=(">",))
    return {"edge": edge, "dispatcher": dispatcher, "worker": worker, "admin": admin}


@dataclass(frozen=True, slots=True)
class Credentials:
    """One role's NATS login."""

    role: str
    user: str
    password: str = field(repr=False)

    @property
    def inbox_prefix(self) -> str:
        return inbox_prefix(self.role)

    def to_toml(self) -> str:
        return (f'# tidegate NATS credentials for the {self.role} tier (keep private)\n'
                f'user = "{self.user}"\npassword = "{self.password}"\n'
                f'inbox_prefix = "{self.inbox_prefix}"\n')


def new_credentials() -> dict[str, Credentials]:
    """Fresh random passwords (192 bits) for every role."""
    return {role: Credentials(role, f"tidegate-{role}", secrets.token_urlsafe(24))
            for role in ROLES}


def server_config(subjects: Subjects, creds: dict[str, Credentials]) -> str:
    """nats-server's ``authorization`` block for these roles and logins.

    No ``no_auth_user``: a connection without credentials is refused.
    """
    rules = table(subjects)
    users = []
    for role in ROLES:
        c = creds[role]
        users.append({"user": c.user, "password": c.password,
                      "permissions": rules[role].as_config()})
    # nats-server's config format accepts JSON syntax.
    return ("# Written by `tidegate nats-config`: one user per tidegate tier.\n"
            "# Permissions: tidegate/broker/permissions.py, docs/security.md.\n"
            "authorization " + json.dumps({"users": users}, indent=2) + "\n")
