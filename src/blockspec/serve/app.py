"""`blockspec serve`: an OpenAI-compatible HTTP server over one SpecDecoder.

One worker thread owns the model. Running requests decode TOGETHER (batched
speculative decoding: one target pass per step for all of them, new ones admitted
between steps); requests beyond the batch wait in a bounded queue (full: HTTP 429).
Targets with sliding-window layers fall back to one request at a time. The HTTP side
(FastAPI + uvicorn) only validates, tokenizes, queues and relays. Each request's
chunks go back through an asyncio queue, so a streaming client sees text as soon as
the engine commits it. A client that disconnects, or a request past its deadline, is
cancelled between two engine steps and frees its slot at once.

Errors are OpenAI-shaped JSON (`{"error": {"message", "type", "param", "code"}}`):
400 for a bad request (malformed JSON, a known field with a wrong type or a value outside
OpenAI's range, an unknown model, a prompt that is empty or does not fit, a foreign Host
header on a keyless loopback server), 401 for a missing or wrong API key, 413 for a body
past the cap, 429 (with Retry-After) when the queue is full, 504 when a request runs out
of time, 500 only for a bug, which fails that request alone and is logged with its
traceback. Fields the server does not use are ignored, as OpenAI clients send many.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import queue
import secrets
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.decoding.batched_spec import BatchedSpecEngine
from blockspec.decoding.sampling import SamplingParams
from blockspec.errors import BlockspecError
from blockspec.pipeline import RowText

MAX_N = 8
CHARS_PER_TOKEN = 32
DISCONNECT_CHECK_S = 0.5


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


log = logging.getLogger("blockspec.serve")


def internal_error(error: BaseException) -> "ApiError":
    """A 500 whose body names no internals; the server log keeps the traceback under an id."""
    incident = uuid.uuid4().hex[:12]
    log.error("internal error %s: %s", incident, type(error).__name__,
              exc_info=(type(error), error, error.__traceback__))
    return ApiError(500, f"internal server error (logged as {incident})", kind="server_error")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# --- request schemas: unknown fields ignored, known ones strictly checked ---------------
# OpenAI's ranges and types: a JSON `true` or `"5"` is not a number, nor `"yes"` a boolean.

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 512
INT64 = 2**63
ROLES = ("system", "developer", "user", "assistant", "tool")


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, gt=0)
    max_completion_tokens: StrictInt | None = Field(default=None, gt=0)
    # 0..2 as OpenAI; a tiny positive temperature is sampled safely (sampling.warp_probs)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: StrictInt = Field(default=0, ge=0)  # 0: off
    seed: StrictInt | None = Field(default=None, ge=-INT64, lt=INT64)
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: dict | None = None

    @field_validator("temperature", "top_p", mode="before")
    @classmethod
    def _a_number(cls, value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        return value

    @field_validator("stop")
    @classmethod
    def _bounded_stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences")
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise ValueError(f"a stop sequence holds at most {MAX_STOP_CHARS} characters")
        return value

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]
    content: StrictStr | list[ContentPart] | None = None

    def text(self) -> str:
        """The message's text: a string, or its text parts joined (OpenAI's content parts)."""
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


# --- metrics -------------------------------------------------------------------------

class Metrics:
    """Counters named like the serving engines' speculative metrics."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("blockspec_requests", "Requests served (finished, any outcome)", ["route"], registry=r)
        self.errors = Counter("blockspec_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("blockspec_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("blockspec_generation_tokens", "Tokens generated", registry=r)
        self.drafts = Counter("blockspec_spec_decode_num_drafts", "Verify steps that checked a draft", registry=r)
        self.draft_tokens = Counter("blockspec_spec_decode_num_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("blockspec_spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       registry=r)
        self.accepted_per_pos = Counter("blockspec_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"], registry=r)
        self.tpot = Histogram("blockspec_time_per_output_token_seconds", "Decode time per output token",
                              buckets=(0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0),
                              registry=r)

    def record(self, result) -> None:
        stats = result.stats
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(len(result.token_ids))
        proposed = sum(stats.proposed_by_pos)
        if proposed:
            self.drafts.inc(stats.proposed_by_pos[0])  # steps that proposed at least one draft token
            self.draft_tokens.inc(proposed)
            self.accepted_tokens.inc(sum(stats.accepted_by_pos))
            for position, accepted in enumerate(stats.accepted_by_pos, 1):
                self.accepted_per_pos.labels(position=str(position)).inc(accepted)
        if len(result.token_ids) > 1:
            self.tpot.observe(stats.decode_s / (len(result.token_ids) - 1))


# --- the worker ----------------------------------------------------------------------

@dataclass
class Job:
    prompt: object  # text, or chat messages
    prompt_ids: list[int]  # tokenized once, on the HTTP side
    raw: bool
    options: dict
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    checked_at: float = field(default_factory=time.monotonic)  # when the client was last seen connected


class Worker(threading.Thread):
    """Owns the decoder. Events sent back per job: ("text", piece), ("done", GenerationResult),
    ("error", ApiError).

    With a full-attention target, jobs decode TOGETHER (BatchedSpecEngine: one target pass
    per step for every running job, new jobs admitted between steps); otherwise (e.g.
    sliding-window layers) one at a time in arrival order."""

    def __init__(self, decoder, max_queue: int, metrics: Metrics, max_batch: int = 8):
        super().__init__(daemon=True, name="blockspec-worker")
        self.decoder, self.metrics = decoder, metrics
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self.batched = None
        if max_batch > 1:
            try:
                self.batched = BatchedSpecEngine(decoder.target, decoder.drafter, decoder.block_size, max_batch)
            except BlockspecError as why:
                print(f"blockspec serve: requests will decode one at a time ({why})", flush=True)

    def submit(self, job: Job) -> None:
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise ApiError(429, "the server is busy: too many queued requests, retry later",
                           kind="rate_limit_error") from None

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
                    self._send(job, ("error", ApiError(503, "the server is shutting down", kind="server_error")))

    def run(self) -> None:
        if self.batched is not None:
            self._run_batched()
            return
        while (job := self.jobs.get()) is not None:
            self._run(job)

    def _send(self, job: Job, event) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (shutdown): nobody is listening
            pass

    def _run(self, job: Job) -> None:
        if job.cancelled.is_set():
            return
        if time.monotonic() > job.deadline:
            self._send(job, ("error", ApiError(504, "the request timed out in the queue", kind="timeout")))
            return
        try:
            def should_stop():
                return job.cancelled.is_set() or time.monotonic() > job.deadline

            for piece in self.decoder.stream(job.prompt, raw=job.raw, should_stop=should_stop, **job.options):
                self._send(job, ("text", piece))
            result = self.decoder.last_result
            if result.finish_reason == "cancelled" and not job.cancelled.is_set():
                self._send(job, ("error", ApiError(504, "the request timed out", kind="timeout")))
                return
            self.metrics.record(result)
            self._send(job, ("done", result))
        except BlockspecError as error:
            self._send(job, ("error", ApiError(400, str(error))))
        except Exception as error:  # never let one request kill the worker
            self._send(job, ("error", internal_error(error)))

    # --- many jobs at once ------------------------------------------------------------
    def _run_batched(self) -> None:
        running: list[_Running] = []
        while True:
            arrived = []
            if not self.batched.busy:
                arrived.append(self.jobs.get())  # idle: wait for work
            # take jobs only while the batch has room: the rest wait in the bounded queue (429 when full)
            while len(self.batched.rows) + len(self.batched.waiting) + len(arrived) < self.batched.max_batch:
                try:
                    arrived.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            if None in arrived:
                for job in arrived + [entry.job for entry in running]:
                    if job is not None:
                        self._send(job, ("error", ApiError(503, "the server is shutting down", kind="server_error")))
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
                self.batched.step()
            except Exception as error:  # a failed step fails the jobs in it, never the server
                failure = internal_error(error)
                for entry in running:
                    if not entry.done:
                        entry.failed = entry.done = True
                        self._send(entry.job, ("error", failure))
                self.batched.reset()
                running = []

    def _admit(self, job: Job):
        if job.cancelled.is_set():
            return None
        if time.monotonic() > job.deadline:
            self._send(job, ("error", ApiError(504, "the request timed out in the queue", kind="timeout")))
            return None
        options = job.options
        try:
            params = SamplingParams(temperature=options["temperature"], top_p=options["top_p"], top_k=options["top_k"],
                                    seed=options.get("seed"))
            text = RowText(self.decoder.target, options["stop"], len(job.prompt_ids),
                           [] if options.get("logprobs") is not None else None,
                           on_text=lambda piece: self._send(job, ("text", piece)))
            entry = _Running(job, text)
            text.row = self.batched.add(job.prompt_ids, max_new_tokens=options["max_new_tokens"], params=params,
                                        on_chunk=lambda chunk: self._on_chunk(entry, chunk),
                                        on_done=lambda stats: self._on_done(entry, stats),
                                        logprobs=text.logprobs, top_logprobs=options.get("logprobs") or 0)
            return entry
        except BlockspecError as error:
            self._send(job, ("error", ApiError(400, str(error))))
        except Exception as error:
            self._send(job, ("error", internal_error(error)))
        return None

    def _on_chunk(self, entry: "_Running", chunk: list[int]) -> None:
        if not entry.job.cancelled.is_set():  # the client left: its row leaves at the next step, unread
            entry.text.on_chunk(chunk)

    def _on_done(self, entry: "_Running", stats) -> None:
        if entry.failed:
            return
        entry.done = True
        if entry.job.cancelled.is_set():
            return
        if entry.row.error is not None:  # this request alone failed
            self._send(entry.job, ("error", internal_error(entry.row.error)))
            return
        if entry.timed_out:
            self._send(entry.job, ("error", ApiError(504, "the request timed out", kind="timeout")))
            return
        result = entry.text.finish(stats)
        self.metrics.record(result)
        self._send(entry.job, ("done", result))


@dataclass
class _Running:
    job: Job
    text: RowText
    timed_out: bool = False
    done: bool = False
    failed: bool = False

    @property
    def row(self):
        return self.text.row


# --- before the routes: host, key, body size; one log line per request -------------------

class _BodyTooLarge(Exception):
    pass


class Guard:
    """ASGI middleware in front of every route: the Host header of a keyless server (DNS
    rebinding), the API key (`Authorization: Bearer KEY`, the scheme in any case; never
    logged), and the body size (413 from Content-Length, or as soon as a streamed body
    passes the cap: nothing large is ever buffered). Logs one line per request."""

    def __init__(self, app, config: "ServerConfig", metrics: Metrics):
        self.app, self.config, self.metrics = app, config, metrics

    def _refusal(self, headers: dict, path: str) -> tuple[int, str, str] | None:
        config = self.config
        if config.api_key is None and config.allowed_hosts is not None:
            host = headers.get("host", "")
            if host.startswith("["):  # [v6]:port or [v6]
                name = host[: host.find("]") + 1]
            else:  # name:port, name, or a bare v6 address
                name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
            if name not in config.allowed_hosts:
                return 400, f"Host {host!r} is not served here (a keyless server answers only its own names)", \
                    "invalid_request_error"
        if config.api_key and path != "/health":
            scheme, _, token = headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), config.api_key.encode()):
                return 401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error"
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > config.max_body_bytes):
            return 413, f"the request body is larger than {config.max_body_bytes} bytes", "invalid_request_error"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        state = {"status": 0, "too_large": False, "replaced": False}

        async def refuse(status: int, message: str, kind: str):
            self.metrics.errors.labels(status=str(status)).inc()
            response = JSONResponse(error_body(message, kind), status_code=status)
            await response(scope, receive, logged_send)

        async def logged_send(message):
            if message["type"] == "http.response.start":
                state["status"] = message["status"]
            await send(message)

        async def capped_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] = state.get("received", 0) + len(message.get("body", b""))
                if state["received"] > self.config.max_body_bytes:
                    state["too_large"] = True
                    return {"type": "http.disconnect"}  # the app stops reading; we answer 413 instead
            return message

        async def guarded_send(message):
            if state["too_large"]:  # whatever the app answers to a cut body, the client gets the 413
                if not state["replaced"]:
                    state["replaced"] = True
                    await refuse(413, f"the request body is larger than {self.config.max_body_bytes} bytes",
                                 "invalid_request_error")
                return
            await logged_send(message)

        try:
            refusal = self._refusal(headers, scope.get("path", ""))
            if refusal is not None:
                await refuse(*refusal)
                return
            try:
                await self.app(scope, capped_receive, guarded_send)
            except Exception:
                if not state["too_large"]:
                    raise
            if state["too_large"] and not state["replaced"]:
                state["replaced"] = True
                await refuse(413, f"the request body is larger than {self.config.max_body_bytes} bytes",
                             "invalid_request_error")
        finally:
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.0fms", client[0], scope.get("method", "-"), scope.get("path", "-"),
                     state["status"], (time.monotonic() - started) * 1000)


# --- the app -------------------------------------------------------------------------

@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_queue: int = 32
    request_timeout_s: float = 300.0
    max_batch: int = 8  # sequences decoded together (1: one at a time)
    max_body_bytes: int = 2 * 2**20  # a request body beyond this is refused (413) before it is parsed
    # Host headers accepted without an API key (DNS rebinding): a keyless server answers only
    # requests addressed to these names; None = any (a server with a key checks the key instead)
    allowed_hosts: tuple[str, ...] | None = ("127.0.0.1", "localhost", "[::1]", "::1")

    def __post_init__(self):
        if not (isinstance(self.request_timeout_s, (int, float)) and math.isfinite(self.request_timeout_s)
                and self.request_timeout_s > 0):
            raise BlockspecError(f"request timeout must be a positive number of seconds, got {self.request_timeout_s}")
        if self.max_queue < 1 or self.max_batch < 1 or self.max_body_bytes < 1024:
            raise BlockspecError("max_queue and max_batch must be >= 1, max_body_bytes >= 1024")


def create_app(decoder, config: ServerConfig) -> FastAPI:
    target = decoder.target
    metrics = Metrics()
    worker = Worker(decoder, config.max_queue, metrics, config.max_batch)
    # one thread tokenizes (tokenizers are not safe to share across threads mid-call), off the event loop
    tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockspec-tokenize")

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.start()
        yield
        worker.stop()
        tokenizing.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="blockspec", version="0.1.0", lifespan=lifespan)
    app.state.worker, app.state.metrics = worker, metrics
    app.add_middleware(Guard, config=config, metrics=metrics)

    def fail(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        metrics.errors.labels(status=str(status)).inc()
        return JSONResponse(error_body(message, kind, param), status_code=status)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError):
        response = fail(error.status, error.message, error.kind, error.param)
        if error.status == 429:
            response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, error: RequestValidationError):
        problems = []
        for item in error.errors():
            where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
            problems.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
        return fail(400, "; ".join(problems) or "invalid request", param=None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException):
        return fail(error.status_code, str(error.detail), "invalid_request_error")

    @app.get("/health")
    async def health():
        if not worker.is_alive():
            return JSONResponse({"status": "worker stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "blockspec"}]}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def check(request: _Common, prompt_ids_len: int) -> dict:
        if request.model != config.model_name:
            raise ApiError(400, f"unknown model {request.model!r}: this server serves {config.model_name!r}", "model")
        if request.stream and (getattr(request, "logprobs", None) not in (None, False)):
            raise ApiError(400, "logprobs are not supported with stream=true", "logprobs")
        room = target.max_context - prompt_ids_len
        if room <= 0:
            raise ApiError(400, f"the prompt has {prompt_ids_len} tokens; the model's context is {target.max_context}",
                           "prompt")
        max_tokens = request.max_completion_tokens or request.max_tokens or min(256, room)
        if max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {prompt_ids_len} tokens exceed the model's "
                                f"context of {target.max_context}", "max_tokens")
        return {"max_new_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "stop": request.stops()}

    async def generate(request: _Common, prompt, raw: bool, logprobs: int | None, http: Request, chat: bool):
        field_name = "messages" if chat else "prompt"
        if isinstance(prompt, str) and not prompt.strip() or isinstance(prompt, list) and not prompt:
            raise ApiError(400, "the prompt is empty", field_name)
        if request.n > worker.jobs.maxsize:
            raise ApiError(400, f"n={request.n} is more than this server queues ({worker.jobs.maxsize})", "n")
        # a prompt far past the context is refused before tokenizing (no token is shorter than a character
        # on average, so CHARS_PER_TOKEN x the context is a generous bound)
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if chars > CHARS_PER_TOKEN * target.max_context:
            raise ApiError(400, f"the prompt has {chars} characters, far more than the model's context of "
                                f"{target.max_context} tokens holds", field_name)
        try:
            prompt_ids = await asyncio.get_running_loop().run_in_executor(
                tokenizing, lambda: target.encode_prompt(prompt, raw=raw))
        except Exception as error:  # a chat template can reject a conversation (roles, system turns, ...)
            raise ApiError(400, f"cannot build the prompt: {error}", field_name) from None
        options = check(request, len(prompt_ids))
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + config.request_timeout_s
        if worker.jobs.maxsize - worker.jobs.qsize() < request.n:  # all n choices are queued, or none
            raise ApiError(429, "the server is busy: too many queued requests, retry later", kind="rate_limit_error")
        jobs = []
        try:
            for index in range(request.n):
                seed = None if request.seed is None else request.seed + index
                job = Job(prompt, prompt_ids, raw, dict(options, seed=seed, logprobs=logprobs), loop, asyncio.Queue(),
                          deadline)
                worker.submit(job)
                jobs.append(job)
        except ApiError:
            for job in jobs:
                job.cancelled.set()
            raise
        return jobs, len(prompt_ids)

    async def next_event(job: Job, http: Request):
        """The job's next event; cancels it if the client goes away (checked at least every
        DISCONNECT_CHECK_S, also while events flow: a non-streaming client that left must not
        keep its decode running), and never waits past the deadline (plus a grace for the
        worker to answer) even if the worker died."""
        while True:
            now = time.monotonic()
            if now - job.checked_at >= DISCONNECT_CHECK_S:
                job.checked_at = now
                if await http.is_disconnected():
                    job.cancelled.set()
                    raise ApiError(499, "client disconnected")
            try:
                return await asyncio.wait_for(job.events.get(), timeout=DISCONNECT_CHECK_S)
            except asyncio.TimeoutError:
                if time.monotonic() > job.deadline + 30 or not worker.is_alive():
                    job.cancelled.set()
                    raise ApiError(504, "the request timed out", kind="timeout") from None

    async def collect(job: Job, http: Request):
        """Wait for a job's end."""
        while True:
            kind, payload = await next_event(job, http)
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    def usage(prompt_tokens: int, results) -> dict:
        completion = sum(len(r.token_ids) for r in results)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def spec_accept_length(results) -> float:
        steps = sum(r.stats.steps for r in results)
        committed = sum(max(len(r.token_ids) - 1, 0) for r in results)
        return round(committed / steps, 4) if steps else 1.0

    def finish(result) -> str:
        return "length" if result.finish_reason == "length" else "stop"

    def token_text(token_id: int) -> str:
        return target.decode([token_id])

    def completion_logprobs(result, top: int) -> dict:
        tokens = [token_text(t) for t in result.token_ids]
        offsets, position = [], 0
        for text in tokens:
            offsets.append(position)
            position += len(text)
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in result.logprobs],
                "top_logprobs": [{token_text(i): v for i, v in best} for _, best in result.logprobs] if top else None,
                "text_offset": offsets}

    def chat_logprobs(result) -> dict:
        content = []
        for token_id, (lp, best) in zip(result.token_ids, result.logprobs):
            text = token_text(token_id)
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": [{"token": token_text(i), "logprob": v,
                                              "bytes": list(token_text(i).encode())} for i, v in best]})
        return {"content": content}

    async def stream_response(jobs, prompt_tokens: int, request: _Common, http: Request, chat: bool):
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, reason: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
            return "data: " + json.dumps({"id": request_id, "object": kind, "created": created,
                                          "model": config.model_name, "choices": [choice]}) + "\n\n"

        async def events():
            results = []
            try:
                for index, job in enumerate(jobs):
                    if chat:
                        yield chunk(index, None, None, role=True)
                    while True:
                        try:
                            kind_, payload = await next_event(job, http)
                        except ApiError as error:
                            if error.status == 499:
                                return
                            kind_, payload = "error", error
                        if kind_ == "text":
                            yield chunk(index, payload, None)
                        elif kind_ == "done":
                            results.append(payload)
                            yield chunk(index, None, finish(payload))
                            break
                        else:
                            metrics.errors.labels(status=str(payload.status)).inc()
                            yield "data: " + json.dumps(error_body(payload.message, payload.kind)) + "\n\n"
                            return
                final = {"id": request_id, "object": kind, "created": created, "model": config.model_name,
                         "choices": [], "spec_accept_length": spec_accept_length(results)}
                if (request.stream_options or {}).get("include_usage"):
                    final["usage"] = usage(prompt_tokens, results)
                yield "data: " + json.dumps(final) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:  # the client is gone or the stream ended: free the worker
                for job in jobs:
                    job.cancelled.set()
                metrics.requests.labels(route="chat" if chat else "completions").inc()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, http: Request):
        if isinstance(request.prompt, list) and len(request.prompt) != 1:
            raise ApiError(400, "prompt as a list must hold exactly one string (send one request per prompt)",
                           "prompt")
        prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
        top = request.logprobs
        jobs, prompt_tokens = await generate(request, prompt, True, top, http, chat=False)
        if request.stream:
            return await stream_response(jobs, prompt_tokens, request, http, chat=False)
        try:
            results = [await collect(job, http) for job in jobs]
        finally:
            for job in jobs:
                job.cancelled.set()
            metrics.requests.labels(route="completions").inc()
        choices = [{"index": i, "text": (prompt if request.echo else "") + r.text, "finish_reason": finish(r),
                    "logprobs": completion_logprobs(r, top) if top is not None else None}
                   for i, r in enumerate(results)]
        return {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
                "model": config.model_name, "choices": choices, "usage": usage(prompt_tokens, results),
                "spec_accept_length": spec_accept_length(results)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatRequest, http: Request):
        if not target.has_chat_template:
            raise ApiError(400, f"{config.model_name} has no chat template: use /v1/completions")
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        top = (request.top_logprobs or 0) if request.logprobs else None
        jobs, prompt_tokens = await generate(request, messages, False, top, http, chat=True)
        if request.stream:
            return await stream_response(jobs, prompt_tokens, request, http, chat=True)
        try:
            results = [await collect(job, http) for job in jobs]
        finally:
            for job in jobs:
                job.cancelled.set()
            metrics.requests.labels(route="chat").inc()
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason": finish(r),
                    "logprobs": chat_logprobs(r) if top is not None else None} for i, r in enumerate(results)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion", "created": int(time.time()),
                "model": config.model_name, "choices": choices, "usage": usage(prompt_tokens, results),
                "spec_accept_length": spec_accept_length(results)}

    return app
