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
from collections.abc import AsyncIterator, Mapping
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from edge.validation_responses import validate_request
from tidegate.broker import objects
from tidegate.config import Config, ModelConfig
from tidegate.control.batches import Stores, bucket_names
from tidegate.errors import ApiError
from tidegate.wire.batch import (
    BatchLine,
    BatchRecord,
    FileRecord,
    LineError,
    LineSplitter,
    LineTooLong,
    LineValidator,
    error_line,
    parse_line,
)
from tidegate.wire.protocol import Api, Request

log = logging.getLogger("tidegate.batch")

OK, FAILED = b"o", b"e"
_API = {"/v1/chat/completions": Api.CHAT, "/v1/completions": Api.COMPLETIONS,
        "/v1/responses": Api.RESPONSES, "/v1/embeddings": Api.EMBEDDINGS}
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


def check_body(line: BatchLine, endpoint: str, models: Mapping[str, ModelConfig]) -> Request:
    """The line's body as the edge would validate it; a Request template
    (id and reply filled in by the runner). Raises ApiError."""
    body = {k: v for k, v in line.body.items() if k not in _STREAM_KEYS}
    valid = validate_request(json.dumps(body).encode(), _API[endpoint], models)
    return Request(id="-", reply="-", model=valid.model.name, api=valid.api, stream=False,
                   body=valid.body, created_ms=0, deadline_ms=0, window_bytes=0,
                   window_msgs=0, klass="batch")


async def validate_input(stores: Stores, batch: BatchRecord,
                         models: Mapping[str, ModelConfig]) -> tuple[int, list[LineError]]:
    """Every line checked (JSON, custom_id, url, body, count); the number of
    requests and the errors, each naming its line."""
    validator = LineValidator(batch.endpoint, stores.config.batch.max_lines)
    try:
        async for number, raw in raw_lines(stores, batch.input_file_id):
            parsed = validator.feed(number, raw)
            if parsed is not None:
                try:
                    check_body(parsed, batch.endpoint, models)
                except ApiError as error:
                    validator.error(_body_error(number, error))
    except LineTooLong as exc:
        validator.error(LineError("line_too_long", f"Line {exc.line} is longer than "
                                  f"{stores.config.batch.max_line_bytes} bytes.", exc.line))
    return validator.count, validator.finish()


async def parsed_lines(stores: Stores, batch: BatchRecord) -> AsyncIterator[BatchLine]:
    """The (already validated) requests of the batch's input, in order."""
    async for number, raw in raw_lines(stores, batch.input_file_id):
        yield parse_line(number, raw, batch.endpoint)


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
