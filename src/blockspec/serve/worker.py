"""The worker: one thread that owns the decoding engine, fed by a bounded queue of Jobs.

Every job is a row of the one engine (`blockspec.decoding.engine`). Jobs decode TOGETHER
(BatchedSpecEngine: one target pass per step for every running job, new jobs admitted
between steps, only while the batch has room), sliding-window targets included (their
windows live in the slot cache's mask); where the slot cache cannot serve the target
(other attention kinds), or with --max-batch 1, the engine holds one row at a time and
the others wait in arrival order.
Cancellation (the client left) and deadlines are checked between two engine steps. A
request's failure fails it alone, never the worker. Each job's events go back to its
event loop: ("text", piece), ("done", GenerationResult) or ("error", ApiError).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field

from blockspec.decoding.engine import serving_engine
from blockspec.decoding.sampling import SamplingParams
from blockspec.errors import BlockspecError
from blockspec.pipeline import RowText
from blockspec.serve.metrics import Metrics
from blockspec.serve.schemas import ApiError

log = logging.getLogger("blockspec.serve")


def internal_error(error: BaseException) -> ApiError:
    """A 500 whose body names no internals; the server log keeps the traceback under an id."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s: %s", incident, type(error).__name__,
              exc_info=(type(error), error, error.__traceback__))
    return ApiError(500, f"internal server error (logged as {incident})", kind="server_error")


def request_error(error: Exception) -> ApiError:
    """A request that failed on its own: blockspec refusing it is the request's fault (400),
    anything else a bug (500)."""
    return ApiError(400, str(error)) if isinstance(error, BlockspecError) else internal_error(error)


@dataclass
class Job:
    """One choice of one request: what to decode, and where its events go."""
    prompt: object  # text, or chat messages
    prompt_ids: list[int]  # tokenized once, on the HTTP side
    raw: bool
    options: dict  # SpecDecoder.stream's keyword arguments
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float  # time.monotonic() past which the request has timed out
    cancelled: threading.Event = field(default_factory=threading.Event)
    checked_at: float = field(default_factory=time.monotonic)  # when the client was last seen connected


class Worker(threading.Thread):
    def __init__(self, decoder, max_queue: int, metrics: Metrics, max_batch: int = 8):
        super().__init__(daemon=True, name="blockspec-worker")
        self.decoder, self.metrics = decoder, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)  # None: stop
        self.engine, why_one_at_a_time = serving_engine(decoder.target, decoder.drafter, decoder.block_size, max_batch,
                                                        decoder.tree_budget)
        if why_one_at_a_time:
            print(f"blockspec serve: requests will decode one at a time ({why_one_at_a_time})", flush=True)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError.busy() from None

    def stop(self) -> None:
        while True:  # make room for the stop marker: queued jobs are answered 503
            try:
                self.jobs.put_nowait(None)
                return
            except queue.Full:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    continue
                if job is not None:
                    self._fail(job, ApiError.shutting_down())

    def run(self) -> None:
        running: list[_Running] = []
        while True:
            arrived = []
            if not self.engine.busy:
                arrived.append(self.jobs.get())  # idle: wait for work
            # take jobs only while the batch has room: the rest wait in the bounded queue (429 when full)
            while len(self.engine.rows) + len(self.engine.waiting) + len(arrived) < self.engine.max_batch:
                try:
                    arrived.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            if None in arrived:
                for job in arrived + [entry.job for entry in running]:
                    if job is not None:
                        self._fail(job, ApiError.shutting_down())
                return
            try:
                for job in arrived:
                    entry = self._admit(job)
                    if entry is not None:
                        running.append(entry)
                now = time.monotonic()
                for entry in running:
                    if entry.job.cancelled.is_set():
                        entry.row.cancelled = True
                    elif now > entry.job.deadline and not entry.row.cancelled:
                        entry.timed_out = entry.row.cancelled = True
                running = [entry for entry in running if not entry.done]
                self.engine.step()
            except Exception as error:  # a failed step fails the jobs in it, never the server
                failure = internal_error(error)
                for entry in running:
                    if not entry.done:
                        entry.failed = entry.done = True
                        self._fail(entry.job, failure)
                self.engine.reset()
                running = []

    def _send(self, job: Job, event) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _fail(self, job: Job, error: ApiError) -> None:
        self._send(job, ("error", error))

    def _still_wanted(self, job: Job) -> bool:
        """Whether a job taken from the queue is worth starting: its client may have left,
        or its deadline passed while it waited."""
        if job.cancelled.is_set():
            return False
        if time.monotonic() > job.deadline:
            self._fail(job, ApiError.timed_out(" in the queue"))
            return False
        return True

    def _admit(self, job: Job) -> _Running | None:
        if not self._still_wanted(job):
            return None
        options = job.options
        try:
            params = SamplingParams(temperature=options["temperature"], top_p=options["top_p"], top_k=options["top_k"],
                                    seed=options.get("seed"))
            text = RowText(self.decoder.target, options["stop"], len(job.prompt_ids),
                           [] if options.get("logprobs") is not None else None,
                           on_text=lambda piece: self._send(job, ("text", piece)))
            entry = _Running(job, text)
            text.row = self.engine.add(job.prompt_ids, max_new_tokens=options["max_new_tokens"], params=params,
                                        on_chunk=lambda chunk: self._on_chunk(entry, chunk),
                                        on_done=lambda stats: self._on_done(entry, stats),
                                        logprobs=text.logprobs, top_logprobs=options.get("logprobs") or 0)
            return entry
        except Exception as error:
            self._fail(job, request_error(error))
        return None

    def _on_chunk(self, entry: _Running, chunk: list[int]) -> None:
        if not entry.job.cancelled.is_set():  # the client left: its row leaves at the next step, unread
            entry.text.on_chunk(chunk)

    def _on_done(self, entry: _Running, stats) -> None:
        if entry.failed:
            return
        entry.done = True
        if entry.job.cancelled.is_set():
            return
        if entry.row.error is not None:  # this request alone failed
            self._fail(entry.job, internal_error(entry.row.error))
            return
        if entry.timed_out:
            self._fail(entry.job, ApiError.timed_out())
            return
        result = entry.text.finish(stats)
        self.metrics.record(result)
        self._send(entry.job, ("done", result))


@dataclass
class _Running:
    """A job admitted to the batched engine."""
    job: Job
    text: RowText
    timed_out: bool = False
    done: bool = False  # the engine ended its row
    failed: bool = False  # its step failed: answered already

    @property
    def row(self):
        return self.text.row
