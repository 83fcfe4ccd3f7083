"""OpenAI request bodies (pydantic, strict: a string where a number belongs is a 400, not a guess).

Unknown fields are accepted and ignored, as OpenAI-compatible servers do, so newer clients work;
fields we cannot honour (``n`` > 1, penalties, ``echo``, ``best_of``, top logprobs) are refused
with a message naming them rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Role = Literal["system", "user", "assistant", "tool", "developer"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    stop: str | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False
    user: str | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, value: float) -> float:
        if value != 0.0:
            raise ValueError("penalties are not supported; leave them at 0")
        return value

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=0)] | None = None

    def message_dicts(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Common):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | list[str] | list[list[int]]
    # Log probability of the sampled token only (0); top alternatives are not computed.
    logprobs: Annotated[int, Field(ge=0, le=0)] | None = None
    echo: Literal[False] = False
    best_of: Literal[1] | None = None
    suffix: None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError("only one prompt per request is supported")
            return prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the prompt is empty")
        return prompt

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens
