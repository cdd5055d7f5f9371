"""OpenAI's wire format: the request bodies and their validation, the error body, and the
response and stream bodies built from GenerationResults.

Requests: unknown fields are ignored (OpenAI clients send many), known ones are checked
strictly, with OpenAI's ranges and types: a JSON `true` or `"5"` is not a number, nor
`"yes"` a boolean.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

MAX_N = 8
MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 512
INT64 = 2**63
ROLES = ("system", "developer", "user", "assistant", "tool")


# --- errors --------------------------------------------------------------------------

class ApiError(Exception):
    """A request's failure, answered with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    @classmethod
    def busy(cls) -> ApiError:
        return cls(429, "the server is busy: too many queued requests, retry later", kind="rate_limit_error")

    @classmethod
    def timed_out(cls, where: str = "") -> ApiError:
        return cls(504, f"the request timed out{where}", kind="timeout")

    @classmethod
    def shutting_down(cls) -> ApiError:
        return cls(503, "the server is shutting down", kind="server_error")


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> str:
    """Pydantic's complaints about a request body, as one line: `field: problem; ...`."""
    problems = []
    for item in errors:
        where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
        problems.append(f"{where}: {item.get('msg')}" if where else str(item.get("msg")))
    return "; ".join(problems) or "invalid request"


# --- requests ------------------------------------------------------------------------

class GenerationRequest(BaseModel):
    """The fields completions and chat requests share."""

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


class CompletionRequest(GenerationRequest):
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


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)


# --- responses -----------------------------------------------------------------------
# `results` are the GenerationResults of a request's n choices; `token_text` spells one token.

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, results) -> dict:
    completion = sum(len(r.token_ids) for r in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def spec_accept_length(results) -> float:
    steps = sum(r.stats.steps for r in results)
    committed = sum(max(len(r.token_ids) - 1, 0) for r in results)
    return round(committed / steps, 4) if steps else 1.0


def finish_reason(result) -> str:
    return "length" if result.finish_reason == "length" else "stop"


def completion_logprobs(result, top: int, token_text: TokenText) -> dict:
    tokens = [token_text(t) for t in result.token_ids]
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for lp, _ in result.logprobs],
            "top_logprobs": [{token_text(i): v for i, v in best} for _, best in result.logprobs] if top else None,
            "text_offset": offsets}


def chat_logprobs(result, token_text: TokenText) -> dict:
    content = []
    for token_id, (lp, best) in zip(result.token_ids, result.logprobs):
        text = token_text(token_id)
        content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": token_text(i), "logprob": v,
                                          "bytes": list(token_text(i).encode())} for i, v in best]})
    return {"content": content}


def completion_response(model: str, results, prompt_tokens: int, echo: str, top: int | None,
                        token_text: TokenText) -> dict:
    """`echo`: the prompt, put before each choice's text (or ""); `top`: None for no logprobs."""
    choices = [{"index": i, "text": echo + r.text, "finish_reason": finish_reason(r),
                "logprobs": completion_logprobs(r, top, token_text) if top is not None else None}
               for i, r in enumerate(results)]
    return _response("cmpl", "text_completion", model, choices, prompt_tokens, results)


def chat_response(model: str, results, prompt_tokens: int, logprobs: bool, token_text: TokenText) -> dict:
    choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason": finish_reason(r),
                "logprobs": chat_logprobs(r, token_text) if logprobs else None} for i, r in enumerate(results)]
    return _response("chatcmpl", "chat.completion", model, choices, prompt_tokens, results)


def _response(id_prefix: str, kind: str, model: str, choices: list, prompt_tokens: int, results) -> dict:
    return {"id": f"{id_prefix}-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage(prompt_tokens, results),
            "spec_accept_length": spec_accept_length(results)}


class StreamEvents:
    """The server-sent events of one streamed response (`text_completion` or
    `chat.completion.chunk` chunks), each a ready `data: ...` line."""

    DONE = "data: [DONE]\n\n"

    def __init__(self, model: str, chat: bool):
        self.model, self.chat = model, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        self.kind = "chat.completion.chunk" if chat else "text_completion"
        self.created = int(time.time())

    def role(self, index: int) -> str:
        """A chat choice's first chunk: who speaks."""
        return self._chunk(index, None, None, role=True)

    def text(self, index: int, text: str) -> str:
        return self._chunk(index, text, None)

    def end(self, index: int, result) -> str:
        return self._chunk(index, None, finish_reason(result))

    def final(self, results, prompt_tokens: int, include_usage: bool) -> str:
        """After every choice: no choices, the request's totals."""
        body = {"id": self.id, "object": self.kind, "created": self.created, "model": self.model, "choices": [],
                "spec_accept_length": spec_accept_length(results)}
        if include_usage:
            body["usage"] = usage(prompt_tokens, results)
        return _event(body)

    @staticmethod
    def error(error: ApiError) -> str:
        return _event(error_body(error.message, error.kind))

    def _chunk(self, index: int, text: str | None, reason: str | None, role: bool = False) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": reason}
        return _event({"id": self.id, "object": self.kind, "created": self.created, "model": self.model,
                       "choices": [choice]})


def _event(body: dict) -> str:
    return "data: " + json.dumps(body) + "\n\n"
