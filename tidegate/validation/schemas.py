"""JSON Schemas (2020-12, as OpenAPI 3.1 takes them) of the request bodies the
validators check, gathered for ``/openapi.json``: each dialect's is built beside
its validator, from its own bounds (docs/security.md, "Schema fuzzing").

Invariant: a body these schemas accept passes the validator
(``tests/test_openapi.py`` generates bodies from them and validates each), so
the description a client's tools read never promises more than the edge takes.
The schemas may be stricter than the validator (content parts and blocks of
the known types only; vendor fields pass either way: ``additionalProperties``
is left open). What a schema cannot say is in its description: an embeddings
request is also bounded by inputs x dimensions (``edge.max_response_bytes``).

Model names are a ``$ref`` to one ``ModelName`` schema without an ``enum``:
the description is served without a key (``GET /v1/models`` lists a key's).
"""

from __future__ import annotations

from tidegate.validation.generation import chat_schema, completions_schema
from tidegate.validation.messages import messages_schema
from tidegate.validation.responses import embeddings_schema, responses_schema
from tidegate.validation.schema_parts import (
    JSON_VALUE,
    JSON_VALUE_SCHEMA,
    MODEL_NAME,
    STRING,
    Schema,
    obj,
)
from tidegate.wire.batch import ENDPOINTS

__all__ = ["JSON_VALUE", "MODEL_NAME", "request_schemas"]


def batch_create() -> Schema:
    return obj({
        "input_file_id": {"type": "string", "pattern": "^file-[0-9a-f]{32}$"},
        "endpoint": {"enum": list(ENDPOINTS)},
        "completion_window": {"type": "string", "pattern": "^[1-9][0-9]*[smh]$",
                              "description": "'24h', or a shorter '<n>s|m|h' up to the "
                                             "gateway's batch.max_window."},
        "metadata": {"type": "object", "maxProperties": 16,
                     "propertyNames": {"maxLength": 64},
                     "additionalProperties": {"type": "string", "maxLength": 512}},
    }, ("input_file_id", "endpoint", "completion_window"))


def message_batch(max_requests: int) -> Schema:
    return obj({"requests": {"type": "array", "minItems": 1, "maxItems": max_requests,
                              "items": obj({
                                  "custom_id": {"type": "string",
                                                "pattern": "^[a-zA-Z0-9_-]{1,64}$"},
                                  "params": {"$ref": "#/components/schemas/MessagesRequest"}},
                                  ("custom_id", "params"))}},
                ("requests",), description="Each custom_id unique in the batch.")


def request_schemas(max_tokens: int, max_batch_requests: int) -> dict[str, Schema]:
    """Every request body schema by its component name; ``max_tokens`` is the
    largest output token limit of any configured model, ``max_batch_requests``
    the most requests a Message Batch may hold (``batch.max_lines``)."""
    return {
        "MessageBatchRequest": message_batch(max_batch_requests),
        "ChatCompletionRequest": chat_schema(max_tokens),
        "CompletionRequest": completions_schema(max_tokens),
        "ResponseRequest": responses_schema(max_tokens),
        "EmbeddingRequest": embeddings_schema(),
        "MessagesRequest": messages_schema(max_tokens),
        "CountTokensRequest": messages_schema(max_tokens, count_tokens=True),
        "BatchRequest": batch_create(),
        "FileUpload": obj({"file": {"type": "string", "contentMediaType":
                                     "application/octet-stream"},
                            "purpose": {"const": "batch"}}, ("file", "purpose")),
        JSON_VALUE: JSON_VALUE_SCHEMA,
        MODEL_NAME: {"type": "string", "minLength": 1,
                     "description": "GET /v1/models lists the models your key may use."},
        "Error": obj({"error": obj({"message": STRING, "type": STRING,
                                      "param": {"type": ["string", "null"]},
                                      "code": {"type": ["string", "null"]}},
                                     ("message", "type"))}, ("error",)),
    }
