"""The per-key rules a batch line is held to, as the edge holds a request.

Lines run long after the edge checked the batch's key, so the runner checks
each line again at validation and at release: the key must still exist
(``revoked_api_key``), not have expired (``expired_api_key``), and allow the
line's model (``model_not_allowed``), by the edge's own rule. A failed check
ends lines not yet released; running lines finish.

:class:`BatchKeys` follows the keys bucket live; config keys allow every model
and never expire. Until the bucket's replay is done, :meth:`BatchKeys.check`
answers ``None`` (unknown: release waits). :meth:`BatchKeys.holder` finds
whose a key is for the desk (dispatcher.batch.desk). Docs: docs/batch.md#per-key-rules.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tidegate.config import Config, ModelConfig
from tidegate.control.keys import KEY_ID_LENGTH, KeyRecord, key_digest
from tidegate.errors import ApiError


def _revoked(key_id: str) -> ApiError:
    return ApiError(401, f"The API key that created this batch ({key_id}) was revoked; the "
                         "request was not run.", type="authentication_error",
                    code="revoked_api_key")


@dataclass(frozen=True, slots=True)
class Holder:
    """Whose a key is: the fields a batch record keeps of its creator."""

    tenant: str
    key_id: str
    user: str


def _invalid() -> ApiError:
    return ApiError(401, "Incorrect API key provided (it is not repeated here).",
                    type="authentication_error", code="invalid_api_key")


class BatchKeys:
    """Key id -> record, followed live from the keys bucket (sans-I/O: the
    runner feeds it ``on_put`` / ``on_delete`` / ``on_synced``)."""

    def __init__(self, config: Config) -> None:
        # Whole digests: a key is matched by all of its SHA-256, never by the
        # 12 hex digits of its id (48 bits can be searched for).
        self._static_digests = {key_digest(k) for k in config.api_keys()}
        self._static = {d[:KEY_ID_LENGTH] for d in self._static_digests}
        self._records: dict[str, KeyRecord] = {}
        self._by_digest: dict[str, KeyRecord] = {}
        self.synced = asyncio.Event()

    def on_put(self, digest: str, record: KeyRecord) -> None:
        self._records[digest[:KEY_ID_LENGTH]] = record
        self._by_digest[digest] = record

    def on_delete(self, digest: str) -> None:
        self._records.pop(digest[:KEY_ID_LENGTH], None)
        self._by_digest.pop(digest, None)

    def on_synced(self) -> None:
        self.synced.set()

    def known(self) -> bool:
        """Whether the bucket was read: before that, no line may be judged."""
        return self.synced.is_set()

    def check(self, key_id: str, model: ModelConfig, now: float | None = None) -> None:
        """Raise the :class:`ApiError` the edge would answer for this key and
        model now; return if the line may run. Call only once :meth:`known`."""
        if not key_id or key_id in self._static:
            return  # a config-file key (or a batch from before keys were recorded)
        record = self._records.get(key_id)
        if record is None:
            raise _revoked(key_id)
        if record.expired(time.time() if now is None else now):
            raise ApiError(401, f"The API key that created this batch ({key_id}) has expired; "
                                "the request was not run.", type="authentication_error",
                           code="expired_api_key")
        if record.models and not {model.name, *model.aliases} & set(record.models):
            raise ApiError(403, f"This API key may not use model '{model.name}'. Allowed: "
                                f"{', '.join(record.models)}.", type="permission_error",
                           code="model_not_allowed", param="model")

    def holder(self, authorization: str, now: float | None = None) -> Holder:
        """Whose key the ``Bearer <key>`` value carries, by the edge's rules
        (edge.auth.KeyTable.authenticate): 401 for no such key, a revoked or
        an expired one. Call only once :meth:`known`."""
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise _invalid()
        try:
            digest = key_digest(key)
        except UnicodeEncodeError:
            raise _invalid() from None
        if digest in self._static_digests:
            return Holder("default", digest[:KEY_ID_LENGTH], "")
        record = self._by_digest.get(digest)
        if record is None:
            raise _invalid()
        if record.expired(time.time() if now is None else now):
            raise ApiError(401, f"This API key ({record.key_id}) has expired.",
                           type="authentication_error", code="expired_api_key")
        return Holder(record.tenant, digest[:KEY_ID_LENGTH], record.user)
