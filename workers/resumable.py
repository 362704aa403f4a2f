"""A resumable stream's job: the stream log's writer, readers and grace.

:class:`ResumableJob` is a :class:`workers.job.Job` that also writes every
message it sends to ``<p>.log.<request_id>`` in ``<P>_STREAMLOG``, through the
worker's :class:`~tidegate.wire.mux.StoredOutbox`: each batch stored before the
next, so the log loses no entry, and the live path never waits on it.

Readers: while the original connection reads, the credit window works as for
any job. Once it is gone or another reader attached, output goes on at the
backend's pace into the log. With no reader left, the job generates on for its
grace, then ends the log with ``stream_abandoned``. Past
``resume.max_stream_bytes`` the log ends with ``resume_log_full``.
Docs: docs/resume.md#the-log.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from tidegate import apis
from tidegate.apis.delivered import (
    joined_text,
    responses_continuable,
    responses_seam,
    text_continuable,
)
from tidegate.broker import broker, liveness, patient
from tidegate.errors import ProtocolError
from tidegate.wire import streamlog
from tidegate.wire.delivered import sse_events
from tidegate.wire.flow import first_seq
from tidegate.wire.protocol import (
    DUPLICATE_DELIVERY,
    Continue,
    Done,
    Error,
    ErrorInfo,
    Request,
    decode_session,
)
from tidegate.wire.streamlog import LogCursor, LogEvent
from workers.backends import Backend
from workers.continuation import continued
from workers.job import Job
from workers.job_context import JobContext
from workers.job_state import REQUEUE_DELAY, RESUME_GRACE

log = logging.getLogger("tidegate.worker")

LOG_FULL = "resume_log_full"

# The logs' ends being stored (ResumableJob._confirm_end): held until done,
# since the loop keeps only a weak reference to a task.
_ending: set[asyncio.Task[None]] = set()


def _keep(task: asyncio.Task[None]) -> None:
    _ending.add(task)
    task.add_done_callback(_ending.discard)


async def ends_stored(within: float) -> None:
    """Wait (at most ``within``) for the logs' ends still being stored: a
    draining worker closes its NATS connection only after them."""
    if _ending:
        await asyncio.wait(set(_ending), timeout=within)


def _handed_back(cursor: LogCursor) -> bool:
    """An edge found the worker of the log's last Head dead after output."""
    return bool(cursor.output and cursor.control and cursor.handed_back == cursor.control)


class ResumableJob(Job):
    def __init__(self, msg: Msg, request: Request, backend: Backend, ctx: JobContext) -> None:
        super().__init__(msg, request, backend, ctx)
        cfg = ctx.config.resume
        self._log_subject = streamlog.subject(ctx.config.nats.subjects, request.id)
        self._log_outbox = ctx.log_outbox
        self._log_budget = cfg.max_stream_bytes
        self._lease = 3 * cfg.attach_interval
        self._grace = request.grace
        self.readers: dict[str, float] = {}  # reader id -> when last heard (monotonic)
        self.original = True  # the connection that made the request still reads
        self._grace_timer: asyncio.TimerHandle | None = None
        self._unbound = False
        self._log_put = self._log
        self._held_head = b""  # a redelivered copy's Head, logged once the copy runs
        self._from_log = False  # the edge's go-ahead to continue the log (a Continue)
        self._first_ended = False  # the log's last worker ran the job to its end (_judge_first)
        if request.extra.get("background"):
            # A Responses API background request (edge.background): no
            # connection ever reads it; it generates to its end into the log.
            self.on_detach("")

    # -- the log -----------------------------------------------------------

    def _log(self, message: bytes) -> None:
        budget = self._log_budget
        if budget < 0:
            return  # full: ended with LOG_FULL already
        budget -= len(message)
        if budget < 0:
            log.warning("job %s: stream log past resume.max_stream_bytes; no resume after "
                        "this point", self.request.id)
            message = Error(self.seq, ErrorInfo(
                502, "server_error", LOG_FULL, "This stream outgrew its resume log "
                "(resume.max_stream_bytes); it cannot be resumed past this point.",
                False, 0.0)).encode()
            if not self.original:
                asyncio.get_running_loop().call_soon(self.cancel, LOG_FULL)
        self._log_budget = budget
        outbox = self._log_outbox
        assert outbox is not None  # workers.service always provides one
        outbox.put(self._log_subject, self.request.id, message)

    async def _send(self, payload: bytes) -> None:
        await super()._send(payload)
        attempt = self.msg.metadata.num_delivered
        if attempt > 1 and self.seq == first_seq(attempt):
            # A redelivered copy's Head reaches the log only if the copy runs
            # (_edge_still_waiting): a copy delivered while the first worker
            # still streams (DUPLICATE_DELIVERY) must not end the log's readers.
            self._held_head = payload
        else:
            self._log(payload)
            if self._log_budget >= 0 and isinstance(decode_session(payload), (Done, Error)):
                _keep(asyncio.get_running_loop().create_task(self._confirm_end(payload)))
        if self._unbound:
            self.window.on_ack(self.seq)

    async def _confirm_end(self, end: bytes) -> None:
        """The log's end once more, as a JetStream publish that waits for its
        ack, retried while the log's stream has no leader
        (``tidegate.broker.patient``, for ``edge.publish_patience``).

        The log outbox stores every entry, the end too, unless its patience
        ran out (then a reader ends at the gap, ``stream_gap``, at once);
        this copy keeps the end when the outbox is not the worker's stored
        one (tests give it a plain one) and costs one acked publish per
        resumable job. It lands after the first (the outbox is flushed
        first): readers skip it as a duplicate (``LogCursor``)."""
        outbox = self._log_outbox
        assert outbox is not None
        await outbox.flush()
        config = self.ctx.config
        msg_id = f"{self.request.id}.{self.msg.metadata.num_delivered}.{self.seq}"
        try:
            await patient.publish(broker.jetstream(self.ctx.nc, config.nats), self.ctx.nc,
                                  self._log_subject, end, {"Nats-Msg-Id": msg_id},
                                  config.edge.publish_patience)
        except Exception as exc:  # out of patience, or the worker is going
            log.warning("job %s: its log's end was not stored: %s", self.request.id, exc)

    @property
    def log_continuable(self) -> bool:
        """Whether a later copy could continue this job from its log (not
        past ``resume.max_stream_bytes``)."""
        return self._log_budget >= 0

    async def _requeue(self) -> None:
        """A preempted job (workers.preemption) goes back to JetStream: its
        log stored up to here, then, after output, its own ``LogHandBack`` (a
        later copy continues the log on it, without asking this worker), and
        its message NAKed with :data:`REQUEUE_DELAY`, so the interactive
        request that wanted the slot gets it first."""
        outbox = self._log_outbox
        assert outbox is not None
        await outbox.flush()
        if self.chunks_sent:
            config = self.ctx.config
            attempt = self.msg.metadata.num_delivered
            try:
                await patient.publish(
                    broker.jetstream(self.ctx.nc, config.nats), self.ctx.nc, self._log_subject,
                    streamlog.LogHandBack(self.ctx.control_subject, preempted=True).encode(),
                    {"Nats-Msg-Id": f"{self.request.id}.{attempt}.handback"},
                    config.edge.publish_patience)
            except Exception as exc:  # the next copy asks this worker instead (_judge_first)
                log.warning("job %s: its hand-back was not stored: %s", self.request.id, exc)
        log.info("job %s preempted after %d chunks; back in %gs", self.request.id,
                 self.chunks_sent, REQUEUE_DELAY)
        await self.msg.nak(delay=REQUEUE_DELAY)

    def _account(self, data: bytes) -> bytes:
        message = super()._account(data)
        if self._unbound:
            # Nobody's acks bound the output any more, so nothing is kept for
            # a retransmit either: the log holds it (a reader that missed
            # something resumes from there).
            self.window.on_ack(self.seq)
        return message

    def data(self, data: bytes) -> None:
        # The push path's chunk (see Job.data), also into the log.
        message = self._account(data)
        assert self.outbox is not None
        self.outbox.put(self.request.mux, self.request.id, message)
        self._log(message)

    # -- a redelivered job ----------------------------------------------------

    def on_continue(self, go: Continue) -> None:
        """The edge's go-ahead after output: continue the stream. The text to
        continue is the log's (:meth:`_edge_still_waiting`), which every reader
        shares, not the edge's (whose client is sent to resume from the log)."""
        if not self._edge_confirmed.is_set():
            self._from_log = True
        self.on_ack(0)

    async def _edge_still_waiting(self) -> bool:
        """Whether this redelivered copy runs, from its edge's word and its log.

        The edge's word comes first (a ``Cancel``, the first copy alive, ends
        this task inside the wait), unless the log holds that edge's hand-back
        (``LogHandBack``); a background response has no edge::

            edge's word                     the dead attempt's log          this copy
            Ack seq 0                       not read again                  runs again
            Continue, hand-back or none     no output                       runs again
            Continue or hand-back           output, continuable             continues it
            anything else                   output, an end, or unreadable   does not run

        A copy that does not run leaves readers to end with ``worker_lost``.
        Its ``Head`` reaches the log only if it runs."""
        read = await self._read_log()
        if read is None or not _handed_back(read[0]):
            if self.cancel_reason:  # see below: not a wait for a word that came
                raise asyncio.CancelledError
            confirmed = (not self.request.extra.get("background")
                         and await super()._edge_still_waiting())
            read = None if confirmed and not self._from_log else await self._read_log()
        else:
            confirmed = False  # the edge's hand-back is its word
        if read is None:
            runs = confirmed  # its client got nothing: the edge's word, the log unread
        else:
            cursor, events = read
            if (not confirmed and not self._from_log and not _handed_back(cursor)
                    and not cursor.ended and cursor.control):
                await self._judge_first(cursor.control)
            runs = not cursor.ended and not self._first_ended and (not cursor.output or (
                (self._from_log or _handed_back(cursor)) and self._continue_log(events)))
        if self.cancel_reason:
            # Its edge's cancel (DUPLICATE_DELIVERY) came during a log read,
            # and the NATS client's request swallowed the task's cancellation
            # (seen once under load): the copy must still end as cancelled,
            # not be dropped with a usage record and an ack.
            raise asyncio.CancelledError
        held, self._held_head = self._held_head, b""
        if runs and held:
            self._log(held)
        return runs

    async def _judge_first(self, control: str) -> None:
        """No edge spoke for this copy (its client left, its edge died, a
        background response has none): it asks the worker of the log's last
        Head (at ``control``) itself whether that worker still runs the job
        (``tidegate.broker.liveness.runs``, on the worker's presence subject).
        Yes: this is a second delivery, and the copy ends without a trace
        (``DUPLICATE_DELIVERY``: no record, no ack, nothing logged; the next
        delivery asks again). Ended there lately: the job is done (a NATS
        node's death lost its ack, and perhaps its log's last entries), and
        the copy does not run (a continuation would add text after its end).
        No (the worker is gone, or lives without the job): that is the word
        an edge's hand-back would have been, and the copy continues the log.
        Unknown (this worker cannot ask): as before, the log alone decides."""
        if control == self.ctx.control_subject:
            # This worker's own earlier attempt, no longer running (a copy of
            # a job it runs is dropped before this). Ended here (its tail
            # ends with its Done or Error), the job is done, as another
            # worker's "ended" says; cut off (fenced), the copy continues.
            tails = self.ctx.tails
            if tails is not None and tails.ended(self.request.id):
                log.info("job %s: this worker ended it lately; this copy does not run",
                         self.request.id)
                self._first_ended = True
            else:
                self._from_log = True
            return
        presence = self.ctx.config.nats.subjects.presence_of(control)
        interval = self.ctx.config.session.liveness_interval
        running = (await liveness.runs(self.ctx.nc, presence, self.request.id, interval)
                   if presence and interval > 0 else None)
        if running == liveness.RUNNING:
            log.info("job %s: its first worker %s still runs it; this copy is a second "
                     "delivery", self.request.id, control)
            self.cancel_reason = DUPLICATE_DELIVERY
            raise asyncio.CancelledError
        if running == liveness.ENDED:
            log.info("job %s: its first worker %s ended it; this copy does not run",
                     self.request.id, control)
            self._first_ended = True
        elif running == liveness.GONE:
            log.info("job %s: no edge spoke and its first worker %s no longer runs it",
                     self.request.id, control)
            self._from_log = True

    def _continue_log(self, events: list[bytes]) -> bool:
        """Continue the text of ``events`` (the log's, in order) if this
        request may be (see workers.continuation); False if not."""
        request = self.request
        model = self.ctx.config.model_index().get(request.model)
        if model is None or model.failover != "continue" or not (
                text_continuable(request) or responses_continuable(request)):
            return False
        parsed = sse_events(events)
        if parsed is None:
            return False
        if apis.of(request.api).numbered_events:
            # A Responses stream's seam, as an edge builds it from what it delivered: the
            # continuation numbers its events on and keeps the client's ids.
            seam = responses_seam(parsed)
            if seam is None:
                return False
            go = Continue(request.id, *seam)
        else:
            got = joined_text(request.api, parsed)
            if got is None:
                return False
            first = parsed[0].get("id") if parsed else None
            go = Continue(request.id, got[0], got[1], 0, first if isinstance(first, str) else "")
        self._origin = (request, go.text, go.tokens)
        self.request, self.continued = continued(request, go.text, go.tokens), go
        log.info("job %s continues its stream log after %d events", request.id, len(events))
        self.on_detach("")  # its client resumes from the log, as a reader
        return True

    async def _read_log(self) -> tuple[LogCursor, list[bytes]] | None:
        """This stream's log read to its end so far (entry by entry from its
        first): the cursor over it and its events' bytes; None when it cannot
        be read."""
        cfg = self.ctx.config
        js = broker.jetstream(self.ctx.nc, cfg.nats)
        stream, seq = streamlog.stream_name(cfg.nats.subjects), 1
        cursor, events = LogCursor(), []
        try:
            while not cursor.ended:
                try:
                    msg = await js.get_msg(stream, seq=seq, subject=self._log_subject,
                                           next=True)
                except nats.js.errors.NotFoundError:
                    break  # read to its end
                for entry in streamlog.decode_entry(msg.data or b""):
                    events += [i.data for i in cursor.feed(entry) if isinstance(i, LogEvent)]
                seq = (msg.seq or seq) + 1
        except (nats.errors.Error, TimeoutError, ProtocolError) as exc:
            log.warning("job %s: cannot read its log (%s); not run again", self.request.id,
                        exc)
            return None
        return cursor, events

    # -- readers -------------------------------------------------------------

    def on_attach(self, reader: str) -> None:
        self.readers[reader] = time.monotonic()
        self._unbind()
        self._check_readers()

    def on_detach(self, reader: str) -> None:
        if reader:
            self.readers.pop(reader, None)
        elif self.original:
            self.original = False
            self._unbind()
            if self._log_budget < 0:
                # The log is full: no reader can resume past its end, so what
                # the backend generates from here reaches no one.
                log.info("job %s: its client left a full log; cancelling", self.request.id)
                asyncio.get_running_loop().call_soon(self.cancel, LOG_FULL)
            else:
                log.info("job %s: its client left; resumable, generating on",
                         self.request.id)
        self._check_readers()

    def _ack_timed_out(self) -> bool:
        # The original edge is gone without a word (killed): a reader may
        # resume anywhere, so this is a detach, not a cancel.
        if self.original:
            self.on_detach("")
        return False

    def _on_tick(self, now: float) -> None:
        super()._on_tick(now)
        stale = [r for r, seen in self.readers.items() if now - seen > self._lease]
        for reader in stale:
            del self.readers[reader]
        if stale:
            self._check_readers()

    def _unbind(self) -> None:
        """Output no longer waits for one reader's acks (see the module docstring)."""
        self.last_ack_at = float("inf")  # and the ack timeout no longer applies
        self._unbound = True
        window = self.window
        window.unbound()
        window.on_ack(window.sent_seq)
        self._window_open.set()
        pushing = self._pushing
        if pushing is not None:
            if self._stalled_at:
                self._stalled(time.monotonic() - self._stalled_at)
                self._stalled_at = 0.0
            pushing.resume()

    def _check_readers(self) -> None:
        if self.original or self.readers:
            if self._grace_timer is not None:
                self._grace_timer.cancel()
                self._grace_timer = None
            return
        if self._grace_timer is None:
            log.info("job %s: no reader left; cancelling in %.1fs unless one comes back",
                     self.request.id, self._grace)
            self._grace_timer = asyncio.get_running_loop().call_later(
                self._grace, self.cancel, RESUME_GRACE)

    def release(self) -> None:
        if self._grace_timer is not None:
            self._grace_timer.cancel()
            self._grace_timer = None
        # A bound method of the job held by the job: a cycle, which would
        # keep every ended resumable job (its request, its body) until the
        # rare full collection (tests/test_job_cycles.py).
        self._log_put = None
        super().release()
