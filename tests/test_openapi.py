"""The OpenAPI description (``edge.openapi``): the same routes as the edge
registers, valid OpenAPI 3.1, and request schemas no looser than the
validators (every body generated from a schema passes its validator)."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, cast

import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from edge.app import build_app
from edge.openapi import document
from edge.state import EdgeState
from tidegate import config as tgconfig
from tidegate.apis import validate_request
from tidegate.errors import ApiError
from tidegate.telemetry import telemetry
from tidegate.validation.messages import validate_messages
from tidegate.validation.schemas import MODEL_NAME
from tidegate.wire.protocol import Api

MODELS = [{"name": "tidegate-sim", "aliases": ["sim"], "max_output_tokens": 4096,
           "simulator": {}}]
CONFIG = tgconfig.from_dict({"models": MODELS})


def described(config: tgconfig.Config) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, ops in document(config)["paths"].items()
            for method in ops}


@pytest.mark.parametrize("metrics_public", [False, True])
def test_the_description_and_the_edges_routes_are_the_same_set(metrics_public: bool) -> None:
    config = tgconfig.from_dict({"models": MODELS, "edge": {"metrics_public": metrics_public}})
    # build_app reads only the config (and /metrics the telemetry) at startup.
    app = build_app(cast(EdgeState, SimpleNamespace(config=config, telemetry=telemetry.get())))
    registered = {(route.method, route.resource.canonical) for route in app.router.routes()
                  if route.method != "HEAD" and route.resource is not None}
    assert ("GET", "/openapi.json") in registered
    assert (("GET", "/metrics") in registered) is metrics_public
    assert registered == described(config)


def test_the_description_is_openapi_3_1_with_valid_schemas() -> None:
    doc = document(CONFIG)
    assert json.loads(json.dumps(doc)) == doc  # plain JSON, served as is
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)
    schema = schemathesis.openapi.from_dict(doc)
    labels = [op.ok().label for op in schema.get_all_operations()]
    assert len(labels) == len(described(CONFIG))
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/chat/completions"]["post"]  # the global bearer


def test_bounds_come_from_the_config_and_no_model_name_is_served() -> None:
    doc = document(tgconfig.from_dict({"models": [*MODELS, {
        "name": "hidden-big", "max_output_tokens": 9999, "simulator": {}}]}))
    text = json.dumps(doc)
    assert "hidden-big" not in text
    assert "tidegate-sim" not in text
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["maximum"] == 9999
    assert chat["model"] == {"$ref": f"#/components/schemas/{MODEL_NAME}"}


def _integral(value: Any) -> Any:
    """``1.0`` as ``1``: JSON Schema counts a number with a zero fraction as an
    integer; the validators (as OpenAI) want integers written as integers,
    which the description says once (``info.description``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 63:
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _with_models(config: tgconfig.Config) -> dict[str, Any]:
    """The description as a key's holder sees it after GET /v1/models:
    model names filled in, so generated bodies reach the validator's depth."""
    doc = document(config)
    doc["components"]["schemas"][MODEL_NAME]["enum"] = sorted(config.model_index())
    return doc


_BODIES = {"/v1/chat/completions": Api.CHAT, "/v1/completions": Api.COMPLETIONS,
           "/v1/responses": Api.RESPONSES, "/v1/embeddings": Api.EMBEDDINGS,
           "/v1/messages": Api.MESSAGES}
_SCHEMA = schemathesis.openapi.from_dict(_with_models(CONFIG))


@pytest.mark.parametrize("path", sorted(_BODIES))
def test_every_body_the_schema_allows_passes_the_validator(path: str) -> None:
    api = _BODIES[path]
    strategy = _SCHEMA[path]["POST"].as_strategy()

    @settings(max_examples=60, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def check(case: Any) -> None:
        raw = json.dumps(_integral(case.body)).encode()
        try:
            validate_request(raw, api, CONFIG.model_index())
        except ApiError as error:
            # The one bound a JSON Schema cannot state (its description says it).
            if not (api is Api.EMBEDDINGS and "over this gateway's limit" in error.message):
                raise AssertionError(f"{path}: the schema allows what the validator refuses: "
                                     f"{error.message} ({error.param})") from None

    check()


@settings(max_examples=40, derandomize=True, database=None, deadline=None,
          suppress_health_check=list(HealthCheck))
@given(_SCHEMA["/v1/messages/count_tokens"]["POST"].as_strategy())
def test_count_tokens_bodies_the_schema_allows_pass(case: Any) -> None:
    validate_messages(json.dumps(_integral(case.body)).encode(), Api.MESSAGES,
                      CONFIG.model_index(), count_tokens=True)


def test_the_validators_refuse_what_the_schemas_refuse() -> None:
    """Spot checks the other way, one per bound the schemas take from code."""
    schemas = _with_models(CONFIG)["components"]["schemas"]
    base = {"model": "sim", "messages": [{"role": "user", "content": "x"}]}
    validator = jsonschema.Draft202012Validator(
        {"$ref": "#/components/schemas/ChatCompletionRequest",
         "components": {"schemas": schemas}})
    assert validator.is_valid(base)
    for extra in ({"stop": ["a"] * 5}, {"stop": "x" * 1001}, {"max_tokens": 4097},
                  {"logit_bias": {str(i): 1 for i in range(301)}}, {"top_logprobs": 3},
                  {"tools": [{"type": "function", "function": {"name": "a b"}}]}):
        body = {**base, **extra}
        assert not validator.is_valid(body), extra
        with pytest.raises(ApiError):
            validate_request(json.dumps(body).encode(), Api.CHAT, CONFIG.model_index())
