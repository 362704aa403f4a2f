"""API key authentication (edge.auth)."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edge.auth import KeyTable, Principal, key_digest
from tidegate.control.keys import KeyRecord
from tidegate.errors import ApiError

KEY = "sk-tidegate-0123456789abcdef"
OTHER = "sk-other-key-fedcba9876543210"


def reject(table: KeyTable, header: str | None) -> ApiError:
    with pytest.raises(ApiError) as info:
        table.authenticate(header)
    error = info.value
    assert error.status == 401
    assert error.type == "authentication_error"
    assert error.param is None
    return error


def test_key_digest_is_sha256_hex() -> None:
    assert key_digest("abc") == hashlib.sha256(b"abc").hexdigest()
    assert key_digest("abc") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
    assert key_digest("é") == hashlib.sha256("é".encode()).hexdigest()


def test_table_length_counts_distinct_keys() -> None:
    assert len(KeyTable()) == 0
    assert len(KeyTable([KEY, OTHER])) == 2
    assert len(KeyTable([KEY, KEY])) == 1


@pytest.mark.parametrize("header", [None, ""])
def test_missing_header(header: str | None) -> None:
    error = reject(KeyTable([KEY]), header)
    assert error.code == "missing_api_key"
    assert "Bearer" in error.message


@pytest.mark.parametrize("header", [
    f"Basic {KEY}",
    f"Token {KEY}",
    KEY,  # no scheme
    "Bearer",  # no key
    "Bearer ",
    "Bearer    ",
    f"Bearer\t{KEY}",  # scheme must be followed by a space
    f" Bearer {KEY}",
])
def test_malformed_header(header: str) -> None:
    error = reject(KeyTable([KEY]), header)
    assert error.code == "invalid_authorization_header"


def test_unknown_key() -> None:
    error = reject(KeyTable([KEY]), f"Bearer {OTHER}")
    assert error.code == "invalid_api_key"
    assert OTHER not in error.message
    assert OTHER[:6] not in error.message
    assert OTHER[-4:] not in error.message


def test_short_unknown_key_is_not_shown() -> None:
    error = reject(KeyTable([KEY]), "Bearer short-key")
    assert error.code == "invalid_api_key"
    assert "short-key" not in error.message


def test_empty_table_rejects_everything() -> None:
    assert reject(KeyTable(), f"Bearer {KEY}").code == "invalid_api_key"


@pytest.mark.parametrize("header", [f"Bearer {KEY}", f"bearer {KEY}", f"BEARER {KEY}",
                                    f"Bearer   {KEY}", f"Bearer {KEY}  "])
def test_known_key_gives_principal(header: str) -> None:
    principal = KeyTable([KEY, OTHER], tenant="acme").authenticate(header)
    assert principal == Principal(tenant="acme", user="", key_id=key_digest(KEY)[:12])


def test_default_tenant_and_distinct_key_ids() -> None:
    table = KeyTable([KEY, OTHER])
    a = table.authenticate(f"Bearer {KEY}")
    b = table.authenticate(f"Bearer {OTHER}")
    assert a.tenant == b.tenant == "default"
    assert a.key_id != b.key_id
    assert len(a.key_id) == 12
    assert KEY not in a.key_id


def test_key_comparison_is_exact() -> None:
    table = KeyTable([KEY])
    for near in (KEY.upper(), KEY[:-1], KEY + "x", " " + KEY + "x"):
        assert reject(table, f"Bearer {near}").code == "invalid_api_key"


def test_principal_is_frozen() -> None:
    principal = KeyTable([KEY]).authenticate(f"Bearer {KEY}")
    with pytest.raises(AttributeError):
        principal.tenant = "x"  # type: ignore[misc]


MESSAGE = "Incorrect API key provided (it is not repeated here)."


@given(st.text(alphabet="ABCDEFabcdef0123456789_-", min_size=1, max_size=80))
def test_unknown_key_never_appears_in_the_message(key: str) -> None:
    """Not whole, and not masked either: one message for every wrong key."""
    error = reject(KeyTable([KEY]), f"Bearer {key}")
    assert error.code == "invalid_api_key"
    assert error.message == MESSAGE


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs", "Zs", "Zl", "Zp", "Cc")),
                        min_size=1, max_size=40), min_size=1, max_size=5, unique=True))
def test_every_configured_key_authenticates(keys: list[str]) -> None:
    table = KeyTable(keys, tenant="t")
    for key in keys:
        principal = table.authenticate(f"Bearer {key}")
        assert principal.key_id == key_digest(key)[:12]
        assert principal.tenant == "t"


def test_check_and_watch_follow_a_kv_key_until_it_is_revoked() -> None:
    """What a WebSocket relies on (edge/ws.py): check() per generation and a
    listener told of every change and of the revoke; static keys never go."""
    table = KeyTable([OTHER])
    digest = key_digest(KEY)
    table.apply(digest, KeyRecord(key_id=digest[:12], tenant="acme"))
    assert KeyTable.digest_of(f"Bearer {KEY} ") == digest
    assert table.check(digest).tenant == "acme"
    seen: list[Principal | None] = []
    stop = table.watch(digest, seen.append)
    table.apply(digest, KeyRecord(key_id=digest[:12], tenant="acme", models=("m",)))
    assert seen[-1] is not None
    assert seen[-1].models == ("m",)
    table.remove(digest)
    assert seen[-1] is None
    with pytest.raises(ApiError) as info:
        table.check(digest)
    assert (info.value.status, info.value.code) == (401, "revoked_api_key")
    assert KEY not in info.value.message
    stop()
    table.apply(digest, KeyRecord(key_id=digest[:12], tenant="acme"))
    assert len(seen) == 2  # stopped: no more calls
    table.apply(digest, KeyRecord(key_id=digest[:12], tenant="acme", expires=1.0))
    with pytest.raises(ApiError) as info:
        table.check(digest)
    assert info.value.code == "expired_api_key"
    static = key_digest(OTHER)
    table.remove(static)
    assert table.check(static).tenant == "default"
