from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Route(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROUTE_UNSPECIFIED: _ClassVar[Route]
    ROUTE_CHAT_COMPLETIONS: _ClassVar[Route]
    ROUTE_COMPLETIONS: _ClassVar[Route]
    ROUTE_RESPONSES: _ClassVar[Route]
    ROUTE_EMBEDDINGS: _ClassVar[Route]
ROUTE_UNSPECIFIED: Route
ROUTE_CHAT_COMPLETIONS: Route
ROUTE_COMPLETIONS: Route
ROUTE_RESPONSES: Route
ROUTE_EMBEDDINGS: Route

class GenerateRequest(_message.Message):
    __slots__ = ("route", "body", "model", "id", "resumable", "resume_grace")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RESUME_GRACE_FIELD_NUMBER: _ClassVar[int]
    route: Route
    body: bytes
    model: str
    id: str
    resumable: bool
    resume_grace: float
    def __init__(self, route: _Optional[_Union[Route, str]] = ..., body: _Optional[bytes] = ..., model: _Optional[str] = ..., id: _Optional[str] = ..., resumable: _Optional[bool] = ..., resume_grace: _Optional[float] = ...) -> None: ...

class Accepted(_message.Message):
    __slots__ = ("request_id", "resumable", "ratelimit")
    class RatelimitEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESUMABLE_FIELD_NUMBER: _ClassVar[int]
    RATELIMIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    resumable: bool
    ratelimit: _containers.ScalarMap[str, str]
    def __init__(self, request_id: _Optional[str] = ..., resumable: _Optional[bool] = ..., ratelimit: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Queued(_message.Message):
    __slots__ = ("position",)
    POSITION_FIELD_NUMBER: _ClassVar[int]
    position: int
    def __init__(self, position: _Optional[int] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("data", "seq")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    seq: int
    def __init__(self, data: _Optional[bytes] = ..., seq: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "finish_reason")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: Usage
    def __init__(self, usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class Reconnect(_message.Message):
    __slots__ = ("request_id", "after")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    after: int
    def __init__(self, request_id: _Optional[str] = ..., after: _Optional[int] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "http_status", "error")
    CODE_FIELD_NUMBER: _ClassVar[int]
    HTTP_STATUS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    code: int
    http_status: int
    error: bytes
    def __init__(self, code: _Optional[int] = ..., http_status: _Optional[int] = ..., error: _Optional[bytes] = ...) -> None: ...

class Cancelled(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("id", "accepted", "queued", "chunk", "done", "reconnect", "error", "cancelled")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    RECONNECT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    id: str
    accepted: Accepted
    queued: Queued
    chunk: Chunk
    done: Done
    reconnect: Reconnect
    error: Error
    cancelled: Cancelled
    def __init__(self, id: _Optional[str] = ..., accepted: _Optional[_Union[Accepted, _Mapping]] = ..., queued: _Optional[_Union[Queued, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., reconnect: _Optional[_Union[Reconnect, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., cancelled: _Optional[_Union[Cancelled, _Mapping]] = ...) -> None: ...

class Cancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Resume(_message.Message):
    __slots__ = ("request_id", "after")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    after: int
    def __init__(self, request_id: _Optional[str] = ..., after: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("id", "generate", "cancel", "resume")
    ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    id: str
    generate: GenerateRequest
    cancel: Cancel
    resume: Resume
    def __init__(self, id: _Optional[str] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[_Union[Cancel, _Mapping]] = ..., resume: _Optional[_Union[Resume, _Mapping]] = ...) -> None: ...
