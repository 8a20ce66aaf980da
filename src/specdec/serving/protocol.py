"""The OpenAI API's request bodies as specdec serves them, and its error shape.

Parameters that would change the output and that specdec does not implement (penalties, logit bias,
log-probabilities, tools, n > 1 ...) are refused with a 400 naming them rather than ignored; unknown
parameters are refused too, so a misspelt one never passes silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: parameters of the OpenAI API that specdec refuses unless left at their no-op value
UNSUPPORTED = {
    "presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": None,
    "logprobs": None, "top_logprobs": None, "best_of": 1, "echo": False, "suffix": None, "tools": None,
    "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
}


#: a stop string is checked against the decoded tail of every new token, so its length costs every step
MAX_STOP_CHARS = 256


class APIError(Exception):
    """An error answered as OpenAI does: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Generation(BaseModel):
    """What both endpoints take. Defaults are the OpenAI API's (temperature 1, top_p 1)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # vLLM's extension; -1 and 0 turn it off
    stop: str | list[str] | None = Field(default=None, validate_default=True)  # a list once validated
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and unused, as a label
    return_token_ids: bool = False  # vLLM's extension: the generated ids beside the text (not with stream)
    # refused unless at their no-op value (see UNSUPPORTED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    best_of: int | None = None
    echo: bool | None = None
    suffix: str | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None

    def new_tokens(self) -> int | None:
        return self.max_tokens

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4 or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop takes up to 4 non-empty strings of at most {MAX_STOP_CHARS} characters")
        return stops

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise APIError(400, f"n = {self.n} is not supported: specdec serve returns one choice per request; "
                                "send n = 1 (or several requests).", param="n")
        for name, neutral in UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and value != neutral and not (name == "logprobs" and value is False):
                raise APIError(400, f"'{name}' is not supported by specdec serve (it would change the output and is "
                                    f"not implemented); leave it out.", param=name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed with stream = true.", param="stream_options")
        if self.return_token_ids and self.stream:
            raise APIError(400, "return_token_ids is only available without stream; leave one of them out.",
                           param="return_token_ids")


class CompletionRequest(_Generation):
    """`prompt`: a string or token ids (a list of ints), or a list holding one of those: one prompt per request."""

    prompt: str | list[int] | list[str] | list[list[int]]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: Any) -> str | list[int]:
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError("give one prompt per request (a string or a list of token ids)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(_Generation):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def finish_reason(stop_reason: str) -> str:
    """specdec's stop reasons as OpenAI's finish_reason."""
    return "stop" if stop_reason in ("eos", "stop_string") else "length"
