"""NATS subject and stream names, from a configurable prefix (``tg``); nowhere else::

    <p>.req.<class>.<tenant>    JetStream <P>_REQUESTS  edge -> dispatcher
    <p>.job.<model>[.<replica>] JetStream <P>_JOBS      dispatcher -> workers
    <p>.out.<edge>.<request>    core NATS               worker/dispatcher -> edge
    <p>.out.<edge>.mux          core NATS               workers -> edge, many sessions
    <p>.ctl.<worker>            core NATS               edge -> worker (acks, cancel)
    <p>.load.<model>            core NATS               workers -> dispatchers
    <p>.usage.<model>           JetStream <P>_USAGE     worker/edge -> dispatchers
    <p>.desk                    core NATS request-reply edge -> dispatchers (file/batch records)
    KV <P>_CANCELS, _KEYS, _POLICIES, _WORKERS, _AFFINITY, _CLAIMS, _RESPONSES

Free-form names map into one token with :func:`encode_token`, a reversible escape,
so two deployments can share an account. Docs: docs/architecture.md#subjects-and-streams.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Bytes that stand for themselves in a token. Everything else, including the
# escape byte "_" itself, is written as "_" followed by two upper-case hex
# digits. The kept set avoids ".", "*", ">", whitespace and anything a JetStream
# consumer name rejects, so an encoded token is also a valid durable name.
_KEEP = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-")
_HEX = b"0123456789ABCDEF"
_ESCAPE = ord("_")
_PREFIX = re.compile(r"[a-z0-9][a-z0-9_-]*")

# Last token of an edge's multiplexed subject; request ids are hex, never this.
MUX_TOKEN = "mux"


def encode_token(name: str) -> str:
    """Encode any non-empty string as one NATS subject token, reversibly.

    ``"meta-llama/Llama-3.1-8B"`` becomes ``"meta-llama_2FLlama-3_2E1-8B"``.
    """
    if not name:
        raise ValueError("cannot encode an empty name as a subject token")
    raw = name.encode("utf-8")
    out = bytearray()
    for byte in raw:
        if byte in _KEEP:
            out.append(byte)
        else:
            out += bytes((_ESCAPE, _HEX[byte >> 4], _HEX[byte & 0xF]))
    return out.decode("ascii")


def decode_token(token: str) -> str:
    """Invert :func:`encode_token`. Raises ``ValueError`` on a malformed token."""
    if not token:
        raise ValueError("empty subject token")
    raw = token.encode("ascii")
    out = bytearray()
    i = 0
    while i < len(raw):
        byte = raw[i]
        if byte == _ESCAPE:
            pair = raw[i + 1 : i + 3]
            if len(pair) != 2 or any(c not in _HEX for c in pair):
                raise ValueError(f"malformed escape in subject token {token!r}")
            value = int(pair, 16)
            if value in _KEEP:
                # Only one spelling per name: "_41" would alias "A".
                raise ValueError(f"non-canonical escape in subject token {token!r}")
            out.append(value)
            i += 3
        elif byte in _KEEP:
            out.append(byte)
            i += 1
        else:
            raise ValueError(f"character {chr(byte)!r} cannot appear in token {token!r}")
    return out.decode("utf-8")


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject and stream names for one prefix."""

    prefix: str = "tg"

    def __post_init__(self) -> None:
        # Lower-case only: stream names upper-case the prefix, so "tg" and "Tg"
        # would otherwise share streams while using different subjects.
        if not _PREFIX.fullmatch(self.prefix):
            raise ValueError(f"invalid subject prefix {self.prefix!r}: use lower-case letters, "
                             "digits, '-' and '_' (it names subjects and streams)")

    # -- JetStream streams -------------------------------------------------
    @property
    def requests_stream(self) -> str:
        return f"{self.prefix.upper()}_REQUESTS"

    @property
    def jobs_stream(self) -> str:
        return f"{self.prefix.upper()}_JOBS"

    @property
    def requests_wildcard(self) -> str:
        return f"{self.prefix}.req.>"

    @property
    def jobs_wildcard(self) -> str:
        return f"{self.prefix}.job.>"

    def request(self, klass: str, tenant: str) -> str:
        return f"{self.prefix}.req.{klass}.{encode_token(tenant)}"

    def job(self, model: str) -> str:
        return f"{self.prefix}.job.{encode_token(model)}"

    def job_replica(self, model: str, replica: str) -> str:
        """One replica's own queue: outside the shared consumer's exact filter
        ``job(model)``, inside ``jobs_wildcard``."""
        return f"{self.prefix}.job.{encode_token(model)}.{encode_token(replica)}"

    # -- consumers ----------------------------------------------------------
    @property
    def dispatcher_consumer(self) -> str:
        return "dispatchers"

    def worker_consumer(self, model: str) -> str:
        return f"workers_{encode_token(model)}"

    def replica_consumer(self, model: str, replica: str) -> str:
        """An encoded token never holds "__" (its escape is "_" plus two hex
        digits), so this cannot collide with another model's consumer."""
        return f"workers_{encode_token(model)}__{encode_token(replica)}"

    # -- core NATS session subjects ------------------------------------------
    def edge_inbox(self, edge_id: str) -> str:
        """Wildcard an edge subscribes once; one session per last token."""
        return f"{self.prefix}.out.{edge_id}.*"

    def out(self, edge_id: str, request_id: str) -> str:
        return f"{self.prefix}.out.{edge_id}.{request_id}"

    def edge_inboxes(self, *subjects: str) -> bool:
        """Whether every non-empty subject is under an edge's inbox
        (``<p>.out.``). A request came off the broker, untrusted: a tier
        answers on its ``reply`` and ``mux`` only when they pass, or a
        forged request could make it publish anywhere."""
        inbox = f"{self.prefix}.out."
        return all(s.startswith(inbox) for s in subjects if s)

    def edge_mux(self, edge_id: str) -> str:
        """Where workers send an edge the messages of many sessions in one NATS
        message. Inside the inbox wildcard; ``MUX_TOKEN`` is never a request id
        (those are hex)."""
        return f"{self.prefix}.out.{edge_id}.{MUX_TOKEN}"

    def load(self, model: str) -> str:
        """Workers -> dispatchers: the load of a model's replicas, on change."""
        return f"{self.prefix}.load.{encode_token(model)}"

    @property
    def load_wildcard(self) -> str:
        return f"{self.prefix}.load.*"

    def preempt(self, model: str) -> str:
        """Dispatchers -> workers: an interactive request waits for a slot of
        ``model``; a worker holding a background response of it (subscribed
        in a queue group only while it does) hands one back (workers.preemption)."""
        return f"{self.prefix}.preempt.{encode_token(model)}"

    @property
    def preempt_wildcard(self) -> str:
        return f"{self.prefix}.preempt.*"

    def control(self, worker_id: str) -> str:
        return f"{self.prefix}.ctl.{worker_id}"

    def presence(self, worker_id: str) -> str:
        """A worker's presence: while its NATS connection lives it subscribes
        here, and, asked with a request id, says whether it runs that job
        (tidegate.broker.liveness.runs). Unlike its control subject, asking
        here commands nothing, so other workers may ask."""
        return f"{self.prefix}.live.{worker_id}"

    def presence_of(self, control: str) -> str:
        """The presence subject of the worker at ``control`` (a Head's), or
        "" if ``control`` is not a worker's control subject of this prefix."""
        head, _, worker_id = control.rpartition(".")
        if head != f"{self.prefix}.ctl" or not worker_id or worker_id == "any":
            return ""
        return self.presence(worker_id)

    @property
    def retransmit_any(self) -> str:
        """Every worker listens here for a ``Retransmit`` from an edge that
        lost a request's Head (which names its worker); the worker that holds
        the request answers, the others ignore it."""
        return f"{self.prefix}.ctl.any"

    @property
    def desk(self) -> str:
        """Edges ask a dispatcher here to write a tenant's file and batch
        records (tidegate.control.desk): edge credentials may not."""
        return f"{self.prefix}.desk"

    @property
    def keys_bucket(self) -> str:
        """KV bucket of API keys (key: SHA-256 hex digest of the API key)."""
        return f"{self.prefix.upper()}_KEYS"

    @property
    def policies_bucket(self) -> str:
        """KV bucket of quota policies (key: the policy's scope)."""
        return f"{self.prefix.upper()}_POLICIES"

    @property
    def usage_stream(self) -> str:
        return f"{self.prefix.upper()}_USAGE"

    @property
    def usage_wildcard(self) -> str:
        return f"{self.prefix}.usage.>"

    def usage(self, model: str) -> str:
        """Worker/edge -> dispatchers: actual usage of one finished request."""
        return f"{self.prefix}.usage.{encode_token(model)}"

    @property
    def workers_bucket(self) -> str:
        """KV bucket where live workers heartbeat their slots (key: worker id)."""
        return f"{self.prefix.upper()}_WORKERS"

    @property
    def affinity_bucket(self) -> str:
        """KV bucket of conversation homes (key: model token + affinity key)."""
        return f"{self.prefix.upper()}_AFFINITY"

    @property
    def claims_bucket(self) -> str:
        """KV bucket of routed jobs' claims (key: request id, value: the copy)."""
        return f"{self.prefix.upper()}_CLAIMS"

    @property
    def bodies_bucket(self) -> str:
        """Object store of request bodies too large for a NATS message (name:
        the request id; tidegate.broker.bodies, the claim check)."""
        return f"{self.prefix.upper()}_BODIES"

    @property
    def responses_bucket(self) -> str:
        """KV bucket of Responses API response owners (key: a hash of the
        response id, value: its tenant; workers.owners)."""
        return f"{self.prefix.upper()}_RESPONSES"

    @property
    def cancels_bucket(self) -> str:
        """KV bucket of cancel tombstones (key: request id, value: reason)."""
        return f"{self.prefix.upper()}_CANCELS"

    def cancel_key(self, request_id: str) -> str:
        """The subject a tombstone is stored under: NATS KV maps key ``k`` of
        bucket ``B`` to ``$KV.B.k``, so a plain publish there is a put."""
        return f"$KV.{self.cancels_bucket}.{request_id}"
