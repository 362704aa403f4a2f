"""The batch runner's file work: read and validate inputs, record results,
write the output and error files. Everything streams; nothing holds a file.

Results: one ``<P>_BATCHOUT`` KV entry per finished line (key
``<batch>.<line>``), the ready-made output line prefixed with ``o`` (output
file) or ``e`` (error file). The entry is *created*, never overwritten, so
whichever attempt of a line finished first is the one in the output, and a
line that ran twice (its runner died and a successor ran it again) is still
written once. Reading them back goes one entry per direct get (wildcard
``next_by_subj``): bounded memory, in stream order; OpenAI does not promise
output order either (match lines by ``custom_id``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from tidegate import apis
from tidegate.broker import objects
from tidegate.config import Config, ModelConfig
from tidegate.control.batches import Stores, bucket_names
from tidegate.errors import ApiError, ProtocolError, invalid_request
from tidegate.telemetry.untrusted import BadInput
from tidegate.validation.jsonbody import parse_object
from tidegate.wire import classes
from tidegate.wire.batch import (
    BatchLine,
    BatchRecord,
    FileRecord,
    KeyRepeated,
    LineError,
    LineSplitter,
    LineTooLong,
    LineValidator,
    error_line,
    pairs_noting_repeats,
    parse_line,
)
from tidegate.wire.protocol import Request

log = logging.getLogger("tidegate.batch")
BAD_LINE = BadInput("dispatcher", log)

OK, FAILED = b"o", b"e"
# What a batch line may not ask for: a batch result is one JSON body.
_STREAM_KEYS = ("stream", "stream_options")


async def raw_lines(stores: Stores, file_id: str) -> AsyncIterator[tuple[int, bytes]]:
    """The input file's non-blank lines, numbered, streamed from the store."""
    splitter = LineSplitter(stores.config.batch.max_line_bytes)
    async for chunk in objects.read(stores.js, stores.files_bucket, file_id):
        for item in splitter.feed(chunk):
            yield item
    for item in splitter.end():
        yield item


def _body_error(line: int, error: ApiError) -> LineError:
    return LineError(error.code or "invalid_request", f"Line {line}: {error.message}", line,
                     error.param)


def line_loader(max_depth: int) -> Callable[[bytes], Any]:
    """How a batch line is parsed: the way the edge parses a request body
    (``tidegate.validation.jsonbody``: bounded nesting, strict JSON, exact integers), and no
    duplicate key in the line's object or in its ``body`` (the object a chat
    request would be), where a normal request refuses them too."""
    def load(raw: bytes) -> Any:
        obj = parse_object(raw, max_depth)
        _no_duplicate_body_keys(raw, obj)
        return obj
    return load


def _no_duplicate_body_keys(raw: bytes, obj: dict[str, Any]) -> None:
    body = obj.get("body")
    if not isinstance(body, dict):
        return
    # The cheap test first, as tidegate.validation.jsonbody does: a duplicated key leaves its
    # quoted spelling twice (or is escaped); only then the exact stdlib pass,
    # which the depth bound above keeps from recursing too deep.
    if not (b"\\u" in raw or any(
            raw.count(b'"' + k.encode("utf-8", "surrogatepass") + b'"') > 1 for k in body)):
        return
    top = json.loads(raw, object_pairs_hook=pairs_noting_repeats)
    inner = top.get("body") if isinstance(top, dict) else None
    if isinstance(inner, KeyRepeated):
        key = inner.repeated()
        raise invalid_request(f"The body has the key {key!r} more than once; each top-level "
                              "key may appear only once.", param=key, code="invalid_json")


def check_body(line: BatchLine, endpoint: str, models: Mapping[str, ModelConfig]) -> Request:
    """The line's body as the edge would validate it; a Request template
    (id and reply filled in by the runner). Raises ApiError, also for a body
    the wire cannot carry (an integer past 64 bits: the edge's 400
    ``invalid_value``), so such a line fails validation instead of failing
    its release (issue 24: ``max_tokens`` 2^64 crashed the dispatcher)."""
    body = {k: v for k, v in line.body.items() if k not in _STREAM_KEYS}
    dialect = apis.by_path(endpoint)
    if dialect is None:  # the edge admits a batch of tidegate.wire.batch.ENDPOINTS only
        raise invalid_request(f"endpoint {endpoint!r} is not served here")
    valid = dialect.validate(json.dumps(body).encode(), models)
    template = Request(id="-", reply="-", model=valid.model.name, api=valid.api, stream=False,
                       body=valid.body, created_ms=0, deadline_ms=0, window_bytes=0,
                       window_msgs=0, klass=classes.BATCH)
    try:
        template.encode()
    except ProtocolError:
        raise invalid_request("The request contains a number outside the 64-bit integer "
                              "range.", code="invalid_value") from None
    return template


async def validate_input(stores: Stores, batch: BatchRecord,
                         models: Mapping[str, ModelConfig],
                         allowed: Callable[[ModelConfig], None] = lambda _: None,
                         ) -> tuple[int, list[LineError]]:
    """Every line checked (JSON, custom_id, url, body, count, and ``allowed``:
    the batch key's rules for the line's model, raising ApiError); the number
    of requests and the errors, each naming its line. A line that makes a
    check fail in an unforeseen way is an error of that line, never of the
    runner."""
    validator = LineValidator(batch.endpoint, stores.config.batch.max_lines,
                              loads=line_loader(stores.config.edge.max_json_depth))
    try:
        async for number, raw in raw_lines(stores, batch.input_file_id):
            try:
                parsed = validator.feed(number, raw)
                if parsed is not None:
                    template = check_body(parsed, batch.endpoint, models)
                    allowed(models[template.model])
            except ApiError as error:
                validator.error(_body_error(number, error))
            except Exception as exc:  # poison: tidegate.broker.poison's rule, per line
                BAD_LINE.drop("batch_line", "poison", f"{type(exc).__name__}: {exc}")
                validator.error(LineError("invalid_request", f"Line {number} could not be "
                                          "processed.", number))
    except LineTooLong as exc:
        validator.error(LineError("line_too_long", f"Line {exc.line} is longer than "
                                  f"{stores.config.batch.max_line_bytes} bytes.", exc.line))
    return validator.count, validator.finish()


async def parsed_lines(stores: Stores, batch: BatchRecord) -> AsyncIterator[BatchLine]:
    """The (already validated) requests of the batch's input, in order."""
    loads = line_loader(stores.config.edge.max_json_depth)
    async for number, raw in raw_lines(stores, batch.input_file_id):
        yield parse_line(number, raw, batch.endpoint, loads)


def key(batch_id: str, line: int) -> str:
    return f"{batch_id}.{line}"


async def record_result(stores: Stores, batch_id: str, line: int, value: bytes) -> bool:
    """Store one line's result unless one is there; returns whether the
    stored result (this one or the earlier) is a success."""
    try:
        await stores.results.create(key(batch_id, line), value)
        return value[:1] == OK
    except nats.js.errors.KeyWrongLastSequenceError:
        entry = await stores.results.get(key(batch_id, line))
        return (entry.value or b"")[:1] == OK


async def _entries(js: JetStreamContext, config: Config,
                   batch_id: str) -> AsyncIterator[tuple[int, bytes]]:
    bucket = bucket_names(config)[3]
    stream, prefix = f"KV_{bucket}", f"$KV.{bucket}.{batch_id}."
    seq = 1
    while True:
        try:
            # Not a direct get: KV buckets are created without allow_direct.
            msg = await js.get_msg(stream, seq=seq, subject=prefix + ">", next=True)
        except nats.js.errors.NotFoundError:
            return
        seq = (msg.seq or seq) + 1
        if (msg.headers and msg.headers.get("KV-Operation")) or not msg.data or not msg.subject:
            continue
        yield int(msg.subject[len(prefix):]), msg.data


async def load_results(stores: Stores, batch_id: str) -> dict[int, bool]:
    """Line -> success, for every line already finished (a successor runner
    resumes from here)."""
    return {line: data[:1] == OK async for line, data in _entries(stores.js, stores.config,
                                                                   batch_id)}


async def _results(stores: Stores, batch_id: str, kind: bytes) -> AsyncIterator[bytes]:
    async for _, data in _entries(stores.js, stores.config, batch_id):
        if data[:1] == kind:
            yield data[1:]


async def _error_lines(stores: Stores, batch: BatchRecord, done: Mapping[int, bool],
                       expired: bool) -> AsyncIterator[bytes]:
    async for data in _results(stores, batch.id, FAILED):
        yield data
    if not expired:
        return
    async for line in parsed_lines(stores, batch):
        if line.line not in done:
            yield error_line(f"{batch.id.removeprefix('batch_')}-{line.line:x}-expired",
                             line.custom_id, "batch_expired", "This request could not be "
                             "executed before the completion window expired.")


async def write_outputs(stores: Stores, batch: BatchRecord, done: Mapping[int, bool],
                        expired: bool) -> tuple[int, int]:
    """Write the output and error files (same ids on a rerun: a successor
    that finalizes again overwrites, never duplicates). Returns the counts
    (completed, failed), expired lines counted as failed."""
    completed = sum(1 for ok in done.values() if ok)
    failed = len(done) - completed + (batch.counts.total - len(done) if expired else 0)
    now = int(time.time())
    ttl = int(stores.config.batch.file_ttl)
    for file_id, name, count, lines in (
            (batch.output_file_id, "output", completed, _results(stores, batch.id, OK)),
            (batch.error_file_id, "errors", failed, _error_lines(stores, batch, done, expired))):
        if not count:
            continue
        size = await objects.put(stores.js, stores.files_bucket, file_id, lines)
        await stores.put_file(FileRecord(id=file_id, tenant=batch.tenant, size=size,
                                         created_at=now, filename=f"{batch.id}_{name}.jsonl",
                                         purpose="batch_output", expires_at=now + ttl))
    return completed, failed


def answer_body(data: bytes) -> Any:
    """The response JSON of a finished line (a backend that answered with
    something else is kept as a string rather than lost)."""
    try:
        return json.loads(data)
    except ValueError:
        return data.decode(errors="replace")
