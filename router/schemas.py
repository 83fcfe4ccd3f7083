"""OpenAI request bodies (pydantic, strict: a string where a number belongs is a 400, not a guess).

Nothing is silently ignored but two descriptive fields that clients send unasked, as vLLM ignores them (see their
comments): ``user`` and a json_schema's ``description``. A field Tandem does not know is a 400 naming it, as OpenAI
answers an unrecognized argument. OpenAI fields Tandem does not implement (``UNSUPPORTED``) are refused with a
message naming them when set to anything but null.
Tandem's own fields (``VENDOR_FIELDS``) are listed in the README.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from workers.protocol.sampling_params import MAX_TOP_LOGPROBS

Role = Literal["system", "user", "assistant", "tool", "developer"]

# OpenAI request fields not implemented (yet): null is accepted (some clients send every field), any other
# value is a 400 naming the field.
UNSUPPORTED = ("functions", "function_call", "suffix", "metadata", "store", "service_tier", "modalities",
               "audio", "prediction", "reasoning_effort", "web_search_options")
# What Tandem accepts beyond OpenAI's API (vLLM's names and meanings).
VENDOR_FIELDS = ("top_k", "min_p", "ignore_eos", "cache_salt", "stop_token_ids", "skip_special_tokens",
                 "repetition_penalty", "min_tokens")
STRICT = ConfigDict(extra="forbid", strict=True)
MAX_CHOICES = 16  # n: sequences a request may ask for (each one decodes on the same worker)
MAX_TOOLS = 128  # OpenAI's limit on functions a request may offer
MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = STRICT
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call the assistant made, as a client sends it back in the conversation."""

    model_config = STRICT
    name: Annotated[str, Field(min_length=1)]
    arguments: str  # a JSON object, as text

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments must be a JSON object as text: {e}") from e
        if not isinstance(value, dict):
            raise ValueError("arguments must be a JSON object as text")
        return arguments


class ToolCall(BaseModel):
    model_config = STRICT
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _tool_fields_by_role(self) -> ChatMessage:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class TextFormat(BaseModel):
    model_config = STRICT
    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_object"]


class JsonSchema(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(min_length=1, max_length=64)]
    # OpenAI shows it to its models; nothing here reads it (the grammar holds the output to the schema), as in vLLM.
    # Accepted all the same: LangChain's structured output builds this object from a function schema and sends the
    # schema's docstring here, so refusing it would refuse those requests.
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(default_factory=dict)
    strict: bool | None = None  # the schema is always enforced; accepted as OpenAI's clients send it


class JsonSchemaFormat(BaseModel):
    model_config = STRICT
    type: Literal["json_schema"]
    json_schema: JsonSchema


class FunctionDefinition(BaseModel):
    model_config = STRICT
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # the schema is always enforced; accepted as OpenAI's clients send it


class ToolDefinition(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT
    type: Literal["function"]
    function: FunctionName


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as chat templates take them: content parts joined, a call's arguments as an object (as
    templates write them with ``tojson``), the other fields only where given."""
    out = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": c.type,
                 "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}}
                for c in m.tool_calls]
        out.append(message)
    return out


class _Common(BaseModel):
    model_config = STRICT

    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=-1)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    seed: int | None = None
    # Each stop string is searched for in the tail of the text at every token: bounded in number and length.
    stop: (Annotated[str, Field(max_length=MAX_STOP_CHARS)]
           | Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=16)]
           | None) = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # OpenAI's routing hint for requests that share prompts (agents send their conversation's id): the router's
    # key for placing them together (router/policy.py). Never hashed into the blocks, unlike cache_salt.
    prompt_cache_key: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    # OpenAI's shape: token ids as JSON object keys (strings), biases in [-100, 100].
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]], Field(max_length=1024)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] | None = None
    skip_special_tokens: bool = True
    # OpenAI's end-user id (for its abuse monitoring and cache bucketing); nothing here reads it, as in vLLM. OpenAI
    # asks clients to send it with every request, so refusing it would break them.
    user: str | None = None

    response_format: Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat,
                               Field(discriminator="type")] | None = None

    # UNSUPPORTED, each declared so that a value other than null is refused by its own name.
    functions: Any = None
    function_call: Any = None
    suffix: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported by this server; leave it out or null")
        return None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        if bias is not None and any(not (key.isascii() and key.isdigit()) for key in bias):
            raise ValueError("logit_bias keys must be token ids (non-negative integers as strings)")
        return bias

    @field_validator("stream_options")
    @classmethod
    def _only_on_a_stream(cls, options: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI and vLLM answer: without a stream the options would be parsed and do nothing. (`stream` is
        # declared first, so it is in info.data once valid.)
        if options is not None and not info.data.get("stream", False):
            raise ValueError("only allowed with stream: true")
        return options

    def logit_bias_pairs(self) -> list[tuple[int, float]]:
        return [(int(key), value) for key, value in (self.logit_bias or {}).items()]

    def json_schema(self) -> str | None:
        """The schema every output must match, as JSON text; None for free text."""
        if isinstance(self.response_format, JsonObjectFormat):
            return '{"type": "object"}'
        if isinstance(self.response_format, JsonSchemaFormat):
            return json.dumps(self.response_format.json_schema.schema_)
        return None

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
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _tool_choice_among_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have the same name")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among tools")
        if self.parallel_tool_calls is not None and not names:
            raise ValueError("parallel_tool_calls needs tools")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return message_dicts(self.messages)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_sequences(self) -> int:
        return self.n


class CompletionRequest(_Common):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)] | list[str] | list[list[int]]
    # The sampled token's log probability and this many likeliest alternatives' (0: none).
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # The prompt first in the text (and, with logprobs, each prompt token's log probability first).
    echo: bool = False
    max_tokens: Annotated[int, Field(ge=0)] | None = None  # 0 (with echo): the prompt alone
    # Sequences drawn; the n with the highest log probability per token are returned.
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > 1 and self.stream:
            raise ValueError("best_of cannot be streamed: the best sequences are known only at the end")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing but the prompt: only with echo")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: the prompt (and its logprobs) and nothing generated."""
        return self.echo and self.max_tokens == 0

    @property
    def num_sequences(self) -> int:
        return self.best_of if self.best_of is not None else self.n

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
        return 1 if self.prompt_only else self.max_tokens  # one token the worker makes, not shown
