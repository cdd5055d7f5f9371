"""The HTTP side: the routes (/health, /v1/models, /metrics, /v1/completions,
/v1/chat/completions) and the handlers that answer every error in OpenAI's shape.

A request is validated (schemas.py), checked against the model (its name, its context),
tokenized off the event loop and queued as n Jobs, all or none; the route then relays the
worker's events, as one body or as server-sent events, and cancels its jobs when it ends,
however it ends. What the routes share lives in a Service, in `app.state.service`.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.serve.metrics import Metrics
from blockspec.serve.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    StreamEvents,
    chat_response,
    completion_response,
    error_body,
    validation_message,
)
from blockspec.serve.worker import Job, Worker

CHARS_PER_TOKEN = 32
DISCONNECT_CHECK_S = 0.5
DEADLINE_GRACE_S = 30  # past its deadline, the worker has this long to answer a request before the route does


class Service:
    """The target (it tokenizes prompts and spells tokens), the worker and the metrics, as
    the routes use them."""

    def __init__(self, target, worker: Worker, metrics: Metrics, model_name: str, request_timeout_s: float):
        self.target, self.worker, self.metrics = target, worker, metrics
        self.model_name, self.request_timeout_s = model_name, request_timeout_s
        # one thread tokenizes (tokenizers are not safe to share across threads mid-call), off the event loop
        self.tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="blockspec-tokenize")

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)

    def token_text(self, token_id: int) -> str:
        return self.target.decode([token_id])

    async def submit(self, request: GenerationRequest, prompt, raw: bool, logprobs: int | None,
                     chat: bool) -> tuple[list[Job], int]:
        """Queue the request's n choices (all or none) -> their jobs, and the prompt's length in tokens."""
        field_name = "messages" if chat else "prompt"
        if isinstance(prompt, str) and not prompt.strip() or isinstance(prompt, list) and not prompt:
            raise ApiError(400, "the prompt is empty", field_name)
        queue_size = self.worker.jobs.maxsize
        if request.n > queue_size:
            raise ApiError(400, f"n={request.n} is more than this server queues ({queue_size})", "n")
        # a prompt far past the context is refused before tokenizing (no token is shorter than a character
        # on average, so CHARS_PER_TOKEN x the context is a generous bound)
        chars = len(prompt) if isinstance(prompt, str) else sum(len(m["content"]) for m in prompt)
        if chars > CHARS_PER_TOKEN * self.target.max_context:
            raise ApiError(400, f"the prompt has {chars} characters, far more than the model's context of "
                                f"{self.target.max_context} tokens holds", field_name)
        loop = asyncio.get_running_loop()
        try:
            prompt_ids = await loop.run_in_executor(self.tokenizing,
                                                    lambda: self.target.encode_prompt(prompt, raw=raw))
        except Exception as error:  # a chat template can reject a conversation (roles, system turns, ...)
            raise ApiError(400, f"cannot build the prompt: {error}", field_name) from None
        options = self._decode_options(request, len(prompt_ids))
        deadline = time.monotonic() + self.request_timeout_s
        if queue_size - self.worker.jobs.qsize() < request.n:
            raise ApiError.busy()
        jobs = []
        try:
            for index in range(request.n):
                seed = None if request.seed is None else request.seed + index
                job = Job(prompt, prompt_ids, raw, dict(options, seed=seed, logprobs=logprobs), loop, asyncio.Queue(),
                          deadline)
                self.worker.submit(job)
                jobs.append(job)
        except ApiError:
            for job in jobs:
                job.cancelled.set()
            raise
        return jobs, len(prompt_ids)

    def _decode_options(self, request: GenerationRequest, prompt_tokens: int) -> dict:
        """Check the request against this server's model -> the decoder's options."""
        if request.model != self.model_name:
            raise ApiError(400, f"unknown model {request.model!r}: this server serves {self.model_name!r}", "model")
        if request.stream and (getattr(request, "logprobs", None) not in (None, False)):
            raise ApiError(400, "logprobs are not supported with stream=true", "logprobs")
        context = self.target.max_context
        room = context - prompt_tokens
        if room <= 0:
            raise ApiError(400, f"the prompt has {prompt_tokens} tokens; the model's context is {context}", "prompt")
        max_tokens = request.max_completion_tokens or request.max_tokens or min(256, room)
        if max_tokens > room:
            raise ApiError(400, f"max_tokens {max_tokens} + the prompt's {prompt_tokens} tokens exceed the model's "
                                f"context of {context}", "max_tokens")
        return {"max_new_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                "top_k": request.top_k, "stop": request.stops()}

    async def next_event(self, job: Job, http: Request):
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
                if time.monotonic() > job.deadline + DEADLINE_GRACE_S or not self.worker.is_alive():
                    job.cancelled.set()
                    raise ApiError.timed_out() from None

    async def collect(self, jobs: list[Job], http: Request, chat: bool) -> list:
        """Every job's GenerationResult, in order; the first error is raised."""
        try:
            return [await self._result(job, http) for job in jobs]
        finally:
            self._release(jobs, chat)

    async def _result(self, job: Job, http: Request):
        while True:
            kind, payload = await self.next_event(job, http)
            if kind == "error":
                raise payload
            if kind == "done":
                return payload

    def stream(self, jobs: list[Job], prompt_tokens: int, request: GenerationRequest, http: Request,
               chat: bool) -> StreamingResponse:
        """The choices one after the other as server-sent events; an error ends the stream with
        an error event, a client that left ends it silently."""
        include_usage = bool((request.stream_options or {}).get("include_usage"))
        return StreamingResponse(self._events(jobs, prompt_tokens, include_usage, http, chat),
                                 media_type="text/event-stream")

    async def _events(self, jobs: list[Job], prompt_tokens: int, include_usage: bool, http: Request, chat: bool):
        events = StreamEvents(self.model_name, chat)
        results = []
        try:
            for index, job in enumerate(jobs):
                if chat:
                    yield events.role(index)
                while True:
                    try:
                        kind, payload = await self.next_event(job, http)
                    except ApiError as error:
                        if error.status == 499:
                            return
                        kind, payload = "error", error
                    if kind == "text":
                        yield events.text(index, payload)
                    elif kind == "done":
                        results.append(payload)
                        yield events.end(index, payload)
                        break
                    else:
                        self.metrics.count_error(payload.status)
                        yield events.error(payload)
                        return
            yield events.final(results, prompt_tokens, include_usage)
            yield events.DONE
        finally:  # the client is gone or the stream ended: free the worker
            self._release(jobs, chat)

    def _release(self, jobs: list[Job], chat: bool) -> None:
        """A request ended, however: cancel what of it still runs, and count it."""
        for job in jobs:
            job.cancelled.set()
        self.metrics.requests.labels(route="chat" if chat else "completions").inc()


def service_of(http: Request) -> Service:
    return http.app.state.service


router = APIRouter()


@router.get("/health")
async def health(http: Request):
    if not service_of(http).worker.is_alive():
        return JSONResponse({"status": "worker stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(http: Request):
    return {"object": "list", "data": [{"id": service_of(http).model_name, "object": "model", "created": 0,
                                        "owned_by": "blockspec"}]}


@router.get("/metrics")
async def prometheus(http: Request):
    return PlainTextResponse(service_of(http).metrics.exposition(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


@router.post("/v1/completions")
async def completions(request: CompletionRequest, http: Request):
    service = service_of(http)
    if isinstance(request.prompt, list) and len(request.prompt) != 1:
        raise ApiError(400, "prompt as a list must hold exactly one string (send one request per prompt)", "prompt")
    prompt = request.prompt if isinstance(request.prompt, str) else request.prompt[0]
    jobs, prompt_tokens = await service.submit(request, prompt, True, request.logprobs, chat=False)
    if request.stream:
        return service.stream(jobs, prompt_tokens, request, http, chat=False)
    results = await service.collect(jobs, http, chat=False)
    return completion_response(service.model_name, results, prompt_tokens, prompt if request.echo else "",
                               request.logprobs, service.token_text)


@router.post("/v1/chat/completions")
async def chat_completions(request: ChatRequest, http: Request):
    service = service_of(http)
    if not service.target.has_chat_template:
        raise ApiError(400, f"{service.model_name} has no chat template: use /v1/completions")
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    top = (request.top_logprobs or 0) if request.logprobs else None
    jobs, prompt_tokens = await service.submit(request, messages, False, top, chat=True)
    if request.stream:
        return service.stream(jobs, prompt_tokens, request, http, chat=True)
    results = await service.collect(jobs, http, chat=True)
    return chat_response(service.model_name, results, prompt_tokens, request.logprobs, service.token_text)


# --- errors, in OpenAI's shape ---------------------------------------------------------

def error_response(metrics: Metrics, status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    metrics.count_error(status)
    return JSONResponse(error_body(message, kind, param), status_code=status)


async def _api_error(http: Request, error: ApiError):
    response = error_response(service_of(http).metrics, error.status, error.message, error.kind, error.param)
    if error.status == 429:
        response.headers["Retry-After"] = "1"
    return response


async def _invalid_request(http: Request, error: RequestValidationError):
    return error_response(service_of(http).metrics, 400, validation_message(error.errors()))


async def _http_error(http: Request, error: StarletteHTTPException):
    return error_response(service_of(http).metrics, error.status_code, str(error.detail))


ERROR_HANDLERS = {ApiError: _api_error, RequestValidationError: _invalid_request, StarletteHTTPException: _http_error}
