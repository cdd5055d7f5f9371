"""`blockspec serve`: an OpenAI-compatible HTTP server over one SpecDecoder.

One worker thread owns the model. Running requests decode TOGETHER (batched
speculative decoding: one target pass per step for all of them, new ones admitted
between steps); requests beyond the batch wait in a bounded queue (full: HTTP 429).
Targets with attention other than full or sliding-window decode one request at a time. The HTTP side
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

The package: schemas.py (OpenAI's request, response and error bodies), worker.py (the
thread that owns the decoder), routes.py (the routes and error handlers), metrics.py
(Prometheus); here, the server's config, the Guard in front of every route, and
`create_app`, which puts them together.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI

from blockspec.errors import BlockspecError
from blockspec.serve.metrics import Metrics
from blockspec.serve.routes import ERROR_HANDLERS, Service, error_response, router
from blockspec.serve.worker import Worker

log = logging.getLogger("blockspec.serve")


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


# --- before the routes: host, key, body size; one log line per request -------------------

class Guard:
    """ASGI middleware in front of every route: the Host header of a keyless server (DNS
    rebinding), the API key (`Authorization: Bearer KEY`, the scheme in any case; never
    logged), and the body size (413 from Content-Length, or as soon as a streamed body
    passes the cap: nothing large is ever buffered). Logs one line per request."""

    def __init__(self, app, config: ServerConfig, metrics: Metrics):
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
            return self._too_large()
        return None

    def _too_large(self) -> tuple[int, str, str]:
        return 413, f"the request body is larger than {self.config.max_body_bytes} bytes", "invalid_request_error"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        state = {"status": 0, "too_large": False, "replaced": False}

        async def refuse(status: int, message: str, kind: str):
            await error_response(self.metrics, status, message, kind)(scope, receive, logged_send)

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
                    await refuse(*self._too_large())
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
                await refuse(*self._too_large())
        finally:
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.0fms", client[0], scope.get("method", "-"), scope.get("path", "-"),
                     state["status"], (time.monotonic() - started) * 1000)


def create_app(decoder, config: ServerConfig) -> FastAPI:
    metrics = Metrics()
    worker = Worker(decoder, config.max_queue, metrics, config.max_batch)
    app = FastAPI(title="blockspec", version="0.1.0", lifespan=_lifespan, exception_handlers=ERROR_HANDLERS)
    app.state.service = Service(decoder.target, worker, metrics, config.model_name, config.request_timeout_s)
    app.state.worker, app.state.metrics = worker, metrics  # for whoever inspects a running app
    app.add_middleware(Guard, config=config, metrics=metrics)
    app.include_router(router)
    return app


@asynccontextmanager
async def _lifespan(app: FastAPI):
    app.state.service.start()
    yield
    app.state.service.stop()
