"""Subject naming and the reversible token escape (tidegate.subjects)."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tidegate.wire.subjects import Subjects, decode_token, encode_token

# A NATS subject token and a JetStream durable/consumer name may both use these.
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]+")

names = st.text(min_size=1)


# --------------------------------------------------------------------------
# encode_token / decode_token
# --------------------------------------------------------------------------


@given(names)
def test_round_trip(name: str) -> None:
    assert decode_token(encode_token(name)) == name


@given(names)
def test_encoded_token_uses_only_safe_characters(name: str) -> None:
    token = encode_token(name)
    assert TOKEN_RE.fullmatch(token), token


@given(names, names)
def test_encoding_is_injective(a: str, b: str) -> None:
    if a != b:
        assert encode_token(a) != encode_token(b)
    else:
        assert encode_token(a) == encode_token(b)


@given(st.text(alphabet="ABCXYZabcxyz0189-", min_size=1))
def test_plain_names_are_kept_as_they_are(name: str) -> None:
    assert encode_token(name) == name


@pytest.mark.parametrize(
    ("name", "token"),
    [
        ("meta-llama/Llama-3.1-8B", "meta-llama_2FLlama-3_2E1-8B"),
        ("qwen2.5:7b", "qwen2_2E5_3A7b"),
        ("a.b", "a_2Eb"),
        ("_", "_5F"),
        ("__", "_5F_5F"),
        ("a b", "a_20b"),
        ("*", "_2A"),
        (">", "_3E"),
        ("é", "_C3_A9"),
        ("日本", "_E6_97_A5_E6_9C_AC"),
        ("🙂", "_F0_9F_99_82"),
        ("tidegate-sim", "tidegate-sim"),
    ],
)
def test_examples(name: str, token: str) -> None:
    assert encode_token(name) == token
    assert decode_token(token) == name


def test_escape_byte_is_never_ambiguous() -> None:
    # "_" itself is escaped, so a literal "_2E" in a name cannot collide with ".".
    assert encode_token("_2E") == "_5F2E"
    assert encode_token("_2E") != encode_token(".")
    assert decode_token("_5F2E") == "_2E"


def test_encode_empty_raises() -> None:
    with pytest.raises(ValueError, match="empty"):
        encode_token("")


@pytest.mark.parametrize(
    "token",
    [
        "",  # empty
        "_",  # escape with no digits
        "a_",  # escape at the end
        "a_4",  # one digit only
        "_4G",  # not hex
        "_zz",
        "_2e",  # lower-case hex is never produced
        "a.b",  # separator
        "a*",
        "a>",
        "a b",
        "a/b",
        "a:b",
        "é",  # non-ASCII
        "_FF",  # escapes decode to invalid UTF-8
        "_C3",  # truncated UTF-8 sequence
    ],
)
def test_malformed_tokens_raise_value_error(token: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case fails a different check
        decode_token(token)


@given(st.text(max_size=12))
def test_decode_raises_only_value_error(token: str) -> None:
    try:
        name = decode_token(token)
    except ValueError:
        return
    assert isinstance(name, str)
    assert name


def test_decode_rejects_non_canonical_escape() -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - any wording of the rejection will do
        decode_token("_41")


# --------------------------------------------------------------------------
# Subjects
# --------------------------------------------------------------------------


def test_default_prefix_names() -> None:
    s = Subjects()
    assert s.prefix == "tg"
    assert s.requests_stream == "TG_REQUESTS"
    assert s.jobs_stream == "TG_JOBS"
    assert s.requests_wildcard == "tg.req.>"
    assert s.jobs_wildcard == "tg.job.>"
    assert s.request("interactive", "acme") == "tg.req.interactive.acme"
    assert s.request("batch", "acme.corp") == "tg.req.batch.acme_2Ecorp"
    assert s.job("meta-llama/Llama-3.1-8B") == "tg.job.meta-llama_2FLlama-3_2E1-8B"
    assert s.dispatcher_consumer == "dispatchers"
    assert s.worker_consumer("qwen2.5:7b") == "workers_qwen2_2E5_3A7b"
    assert s.edge_inbox("e1") == "tg.out.e1.*"
    assert s.out("e1", "r42") == "tg.out.e1.r42"
    assert s.control("w7") == "tg.ctl.w7"
    assert s.cancels_bucket == "TG_CANCELS"


def test_custom_prefix_names() -> None:
    s = Subjects("blue")
    assert s.requests_stream == "BLUE_REQUESTS"
    assert s.jobs_stream == "BLUE_JOBS"
    assert s.request("interactive", "t") == "blue.req.interactive.t"
    assert s.job("m") == "blue.job.m"
    assert s.out("e", "r") == "blue.out.e.r"
    assert s.edge_inbox("e") == "blue.out.e.*"
    assert s.cancels_bucket == "BLUE_CANCELS"


def test_out_subject_matches_edge_inbox_prefix() -> None:
    s = Subjects()
    inbox = s.edge_inbox("edge-1")
    out = s.out("edge-1", "abc123")
    assert inbox.endswith(".*")
    assert out.startswith(inbox[:-1])
    assert out[len(inbox) - 1 :] == "abc123"


@given(names)
def test_job_subject_is_three_tokens_and_reads_back(model: str) -> None:
    subject = Subjects().job(model)
    parts = subject.split(".")
    assert parts[:2] == ["tg", "job"]
    assert len(parts) == 3
    assert decode_token(parts[2]) == model


@given(names)
def test_request_subject_reads_back_tenant(tenant: str) -> None:
    parts = Subjects("p").request("interactive", tenant).split(".")
    assert len(parts) == 4
    assert parts[:3] == ["p", "req", "interactive"]
    assert decode_token(parts[3]) == tenant


@given(names)
def test_worker_consumer_is_a_valid_durable_name(model: str) -> None:
    assert TOKEN_RE.fullmatch(Subjects().worker_consumer(model))


@pytest.mark.parametrize("prefix", ["", "a.b", "a*", "a>", ">", "a b", "a\tb", "a\nb", "a\r"])
def test_bad_prefixes_rejected(prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid subject prefix"):
        Subjects(prefix)


def test_subjects_is_frozen() -> None:
    s = Subjects()
    with pytest.raises(AttributeError):
        s.prefix = "x"  # type: ignore[misc]


@pytest.mark.parametrize("prefix", ["a/b", "a\\b"])
def test_prefix_must_give_valid_stream_names(prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid subject prefix"):
        Subjects(prefix)


def test_prefixes_differing_only_in_case_cannot_collide() -> None:
    # Stream names upper-case the prefix; allowing "Tg" next to "tg" would give
    # two deployments different subjects but the same streams.
    Subjects("tg")
    with pytest.raises(ValueError, match="invalid subject prefix"):
        Subjects("Tg")
