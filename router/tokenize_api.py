"""``POST /tokenize``, ``POST /detokenize`` and ``GET /version``, in vLLM's shapes.

    {"model", "prompt"} or {"model", "messages"[, "tools"]}  ->  {"tokens", "count", "max_model_len"}
    {"model", "tokens"}                           ->  {"prompt"}

A prompt is tokenized as ``/v1/completions`` does it, messages as ``/v1/chat/completions`` does (the
model's chat template with the generation prompt), so a client can count and budget a request's tokens.
"""

from __future__ import annotations

from importlib import metadata
from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from router.errors import error_responses
from router.schemas import MAX_TOOLS, STRICT, ChatMessage, ToolDefinition, message_dicts
from router.state import RouterState
from router.tool_calls import template_tools
from workers.protocol.errors import InvalidRequestError

tokenize_api = APIRouter(responses=error_responses(404))

_MAX_CHARS = 1_000_000  # beyond any model length this serves; tokenizing more only costs time


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str
    prompt: Annotated[str, Field(max_length=_MAX_CHARS)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None  # with messages


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1_000_000)]


def _state(request: Request, model: str) -> RouterState:
    state: RouterState = request.app.state.router
    state.require_model(model)
    return state


@tokenize_api.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, object]:
    state = _state(request, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages")
    if body.tools is not None and body.messages is None:
        raise InvalidRequestError("tools go with messages")
    if body.messages is not None:
        tools = template_tools(body.tools, state.tokenizer)
        tokens = state.tokenizer.apply_chat_template(message_dicts(body.messages), tools)
    else:
        tokens = state.tokenizer.encode(body.prompt or "")
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.cluster_shape().max_model_len}


@tokenize_api.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = _state(request, body.model)
    vocab = state.tokenizer.vocab_size
    if any(t >= vocab for t in body.tokens):
        raise InvalidRequestError(f"token ids must be in [0, {vocab})")
    return {"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)}


@tokenize_api.get("/version")
async def version() -> dict[str, str]:
    return {"version": metadata.version("tandem")}
