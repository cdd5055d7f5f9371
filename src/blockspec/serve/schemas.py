"""OpenAI's wire format: the request bodies and their validation, and the error body.

Requests: unknown fields are ignored (OpenAI clients send many), known ones are checked
strictly, with OpenAI's ranges and types: a JSON `true` or `"5"` is not a number, nor
`"yes"` a boolean.
"""

from __future__ import annotations

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
