"""Which requests are resumable, and with which grace (edge.resume.resume_grace)."""

from __future__ import annotations

import pytest

from edge.resume import resume_grace
from tidegate.config import Config, ModelConfig, ResumeConfig
from tidegate.control.tenants import TenantSettings, TenantTable
from tidegate.errors import ApiError
from tidegate.wire.subjects import encode_token

CONFIG = Config(resume=ResumeConfig(grace=15.0, max_grace=60.0))
PLAIN = ModelConfig(name="m")
RESUMABLE = ModelConfig(name="r", resumable=True)


def table(**tenants: TenantSettings) -> TenantTable:
    t = TenantTable()
    for name, settings in tenants.items():
        t.apply(encode_token(name), settings.encode())
    return t


def test_default_is_not_resumable() -> None:
    assert resume_grace({}, TenantTable(), "acme", PLAIN, CONFIG) is None


def test_header_model_and_tenant_each_opt_in() -> None:
    assert resume_grace({"X-Tidegate-Resumable": "true"}, TenantTable(), "a", PLAIN,
                        CONFIG) == 15.0
    assert resume_grace({}, TenantTable(), "a", RESUMABLE, CONFIG) == 15.0
    tenants = table(acme=TenantSettings("acme", True, 4.0))
    assert resume_grace({}, tenants, "acme", PLAIN, CONFIG) == 4.0
    assert resume_grace({}, tenants, "other", PLAIN, CONFIG) is None


def test_header_false_opts_out_and_grace_header_wins() -> None:
    tenants = table(acme=TenantSettings("acme", True))
    assert resume_grace({"X-Tidegate-Resumable": "false"}, tenants, "acme", RESUMABLE,
                        CONFIG) is None
    assert resume_grace({"X-Tidegate-Resume-Grace": "2.5"}, tenants, "acme", PLAIN,
                        CONFIG) == 2.5


@pytest.mark.parametrize("headers", [{"X-Tidegate-Resumable": "maybe"},
                                     {"X-Tidegate-Resumable": "1",
                                      "X-Tidegate-Resume-Grace": "61"},
                                     {"X-Tidegate-Resumable": "1",
                                      "X-Tidegate-Resume-Grace": "-1"},
                                     {"X-Tidegate-Resumable": "1",
                                      "X-Tidegate-Resume-Grace": "soon"}])
def test_bad_headers_are_400(headers: dict[str, str]) -> None:
    with pytest.raises(ApiError) as info:
        resume_grace(headers, TenantTable(), "a", PLAIN, CONFIG)
    assert info.value.status == 400


def test_tenant_table_ignores_malformed_and_forgets_deleted() -> None:
    t = table(acme=TenantSettings("acme", True))
    t.apply(encode_token("bad"), b"not json")
    assert t.get("bad") is None
    t.remove(encode_token("acme"))
    assert t.get("acme") is None
