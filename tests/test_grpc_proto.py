"""The checked-in gRPC stubs (tidegate/wire/gateway_pb2*.py) are what
tidegate/wire/gateway.proto generates: regenerated here with grpc_tools and
compared byte for byte, but for the version stamps (the protoc and grpcio
that generated them), which the stubs' own runtime checks cover."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tidegate.config import Config, EdgeConfig

ROOT = Path(__file__).resolve().parent.parent
STUBS = ("gateway_pb2.py", "gateway_pb2.pyi", "gateway_pb2_grpc.py")
_VERSION = re.compile(rb"(Protobuf Python Version: [\d.]+|GRPC_GENERATED_VERSION = '[\d.]+'"
                      rb"|_runtime_version\.Domain\.PUBLIC,\n\s*\d+,\n\s*\d+,\n\s*\d+,)")


def _stamp_free(data: bytes) -> bytes:
    return _VERSION.sub(b"<version>", data)


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    protoc = pytest.importorskip("grpc_tools.protoc")
    wire = tmp_path / "tidegate" / "wire"
    wire.mkdir(parents=True)
    shutil.copy(ROOT / "tidegate" / "wire" / "gateway.proto", wire / "gateway.proto")
    code = protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={tmp_path}",
                        f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}",
                        str(wire / "gateway.proto")])
    assert code == 0
    for name in STUBS:
        fresh = (wire / name).read_bytes()
        checked_in = (ROOT / "tidegate" / "wire" / name).read_bytes()
        assert _stamp_free(fresh) == _stamp_free(checked_in), (
            f"tidegate/wire/{name} is stale: regenerate it (see tidegate/wire/gateway.proto)")


def test_grpc_is_off_by_default() -> None:
    assert EdgeConfig().grpc_port == 0
    assert Config().edge.grpc_port == 0


def test_the_docs_name_every_message_field_and_call_of_the_proto() -> None:
    """docs/grpc.md's summary of the service against the proto itself: a
    message, field, enum value or rpc added there fails until it is described."""
    doc = (ROOT / "docs" / "grpc.md").read_text()
    proto = (ROOT / "tidegate" / "wire" / "gateway.proto").read_text()
    code = re.sub(r"//[^\n]*", "", proto)
    names = set(re.findall(r"\b(?:message|enum|rpc|service)\s+(\w+)", code))
    field = r"^\s*(?:optional\s+|repeated\s+)?[\w.<>, ]+\s+(\w+)\s*=\s*\d+;"
    names |= set(re.findall(field, code, re.M))
    names |= set(re.findall(r"^\s*(ROUTE_\w+)\s*=", code, re.M))
    names -= {"ROUTE_UNSPECIFIED"}
    missing = sorted(n for n in names if f"`{n}`" not in doc and f"`{n} " not in doc)
    assert names
    assert missing == [], missing
