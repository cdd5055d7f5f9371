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

schemas.py holds OpenAI's request and error bodies, worker.py the thread that owns the
decoder, metrics.py the Prometheus metrics; here, the HTTP side.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from blockspec.errors import BlockspecError
from blockspec.serve.metrics import Metrics
from blockspec.serve.schemas import ApiError, ChatRequest, CompletionRequest, GenerationRequest, error_body
from blockspec.serve.worker import Job, Worker

CHARS_PER_TOKEN = 32
DISCONNECT_CHECK_S = 0.5

log = logging.getLogger("blockspec.serve")


# --- before the routes: host, key, body size; one log line per request -------------------

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
            self.metrics.count_error(status)
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
        metrics.count_error(status)
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
        return PlainTextResponse(metrics.exposition(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    def check(request: GenerationRequest, prompt_ids_len: int) -> dict:
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

    async def generate(request: GenerationRequest, prompt, raw: bool, logprobs: int | None, http: Request, chat: bool):
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
            raise ApiError.busy()
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
                    raise ApiError.timed_out() from None

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

    async def stream_response(jobs, prompt_tokens: int, request: GenerationRequest, http: Request, chat: bool):
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
                            metrics.count_error(payload.status)
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
