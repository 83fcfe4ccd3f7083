"""``POST /v1/chat/completions`` and ``POST /v1/completions``: validate, tokenize once, dispatch,
answer whole or as SSE.

The first worker chunk is awaited before any response starts, so a request that fails before its
first token (bad input a worker caught, no capacity, a failed transfer) gets a proper HTTP status;
later failures end the stream with an error event and ``[DONE]``. A client that goes away cancels
the request on every worker it touched, streamed or not.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from router.errors import WORKER_ERROR_STATUS, APIError
from router.responses import DONE_EVENT, Completion, error_event
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.sse import EventStreamResponse, until_disconnect
from router.state import RouterState
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import TokenChunk
from workers.protocol.sampling_params import SamplingParams, check_fits

api = APIRouter()

# Tokenizing a huge string takes long; beyond this many characters per allowed token it cannot fit.
_MAX_CHARS_PER_TOKEN = 32


@api.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _serve(request, body, "chat")


@api.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serve(request, body, "completion")


def _tokenize(state: RouterState, body: ChatCompletionRequest | CompletionRequest, max_model_len: int) -> list[int]:
    tok = state.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = body.message_dicts()
        if sum(len(m["content"]) for m in messages) > max_model_len * _MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(f"the messages are far longer than max_model_len {max_model_len} tokens")
        return tok.apply_chat_template(messages)
    prompt = body.prompt
    if isinstance(prompt, str):
        if len(prompt) > max_model_len * _MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(f"the prompt is far longer than max_model_len {max_model_len} tokens")
        return tok.encode(prompt)
    ids = [t for t in prompt if isinstance(t, int)]
    if len(ids) != len(prompt) or any(not 0 <= t < tok.vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {tok.vocab_size})")
    return ids


def _sampling(body: ChatCompletionRequest | CompletionRequest, num_prompt_tokens: int,
              max_model_len: int) -> SamplingParams:
    requested = body.requested_max_tokens
    if requested is None:  # as vLLM: until EOS or the model's length (KV grows as tokens come)
        requested = max(1, max_model_len - num_prompt_tokens)  # a full prompt fails the length check
    check_fits(num_prompt_tokens, requested, max_model_len)
    logprobs = bool(body.logprobs) if isinstance(body, ChatCompletionRequest) else body.logprobs is not None
    return SamplingParams(max_tokens=requested, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop_strings(),
                          ignore_eos=body.ignore_eos, logprobs=logprobs)


async def _serve(request: Request, body: ChatCompletionRequest | CompletionRequest, kind: str) -> Response:
    """Counts the request; a stream is counted by ``_stream`` when it ends."""
    state: RouterState = request.app.state.router
    endpoint = request.scope["path"]  # not request.url: building a URL costs ~50 us
    state.metrics.in_flight.inc()
    status = "500"
    response: Response | None = None
    try:
        response = await _respond(request, state, body, kind, time.perf_counter())
        status = str(response.status_code)
        return response
    except APIError as e:
        status = str(e.status)
        if e.status in (429, 503):
            state.metrics.rejections.labels(reason=(e.code or "unknown").removeprefix("overloaded_")).inc()
        raise
    except InvalidRequestError:
        status = "400"
        raise
    finally:
        if not isinstance(response, EventStreamResponse):
            state.metrics.requests.labels(endpoint, status).inc()
            state.metrics.in_flight.dec()


async def _respond(request: Request, state: RouterState, body: ChatCompletionRequest | CompletionRequest,
                   kind: str, arrival: float) -> Response:
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this server serves {state.model_name!r}",
                       "model_not_found", "model")
    shape = state.cluster_shape()
    prompt_ids = _tokenize(state, body, shape.max_model_len)
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    sampling = _sampling(body, len(prompt_ids), shape.max_model_len)
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    completion = Completion(kind, prefix + uuid.uuid4().hex, state.model_name, sampling.logprobs)
    chunks = state.dispatcher.generate(prompt_ids, sampling, body.cache_salt, shape.block_size)
    first, gone = await until_disconnect(request.receive, _first_chunk(chunks))
    if gone or first is None:  # the client left before the first token: cancel the request
        await chunks.aclose()
        return Response(status_code=499)
    state.metrics.ttft.observe(time.perf_counter() - arrival)
    if body.stream:
        return EventStreamResponse(_stream(state, completion, first, chunks, body.include_usage, arrival,
                                           request.scope["path"]), headers={"Cache-Control": "no-cache"})
    collected, gone = await until_disconnect(request.receive, _collect(completion, first, chunks))
    if gone or collected is None:
        await chunks.aclose()
        return Response(status_code=499)
    state.metrics.output_tokens.inc(completion.num_output_tokens)
    state.metrics.e2e.observe(time.perf_counter() - arrival)
    return JSONResponse(completion.body(state.tokenizer))


async def _first_chunk(chunks: AsyncGenerator[TokenChunk, None]) -> TokenChunk:
    try:
        first = await anext(chunks)
    except StopAsyncIteration as e:
        raise APIError(500, "the worker ended the stream without a token") from e
    if first.error is not None:
        await chunks.aclose()
        raise _worker_error(first)
    return first


def _worker_error(chunk: TokenChunk) -> APIError:
    """A worker's error chunk as the HTTP error its kind means."""
    status = WORKER_ERROR_STATUS.get(chunk.error_kind or "internal", 500)
    return APIError(status, chunk.error or "the worker failed", chunk.error_kind,
                    retry_after_s=1 if status in (429, 503) else None)


async def _collect(completion: Completion, first: TokenChunk, chunks: AsyncGenerator[TokenChunk, None]) -> Completion:
    completion.add(first)
    async for chunk in chunks:
        if chunk.error is not None:
            raise _worker_error(chunk)
        completion.add(chunk)
    return completion


async def _stream(state: RouterState, completion: Completion, first: TokenChunk,
                  chunks: AsyncGenerator[TokenChunk, None], include_usage: bool, arrival: float,
                  endpoint: str) -> AsyncIterator[str]:
    tok = state.tokenizer
    status = "200"
    try:
        if completion.kind == "chat":
            yield completion.role_event()
        chunk: TokenChunk | None = first
        while chunk is not None:
            if chunk.error is not None:
                error = _worker_error(chunk)
                status = str(error.status)
                yield error_event(error.status, error.message, error.code)
                break
            completion.add(chunk)
            event = completion.delta_event(tok, chunk)
            if event is not None:
                yield event
            try:
                chunk = await anext(chunks, None)
            except APIError as e:  # the worker went away mid-stream
                status = str(e.status)
                yield error_event(e.status, e.message, e.code)
                break
        if include_usage and status == "200":
            yield completion.usage_event()
        yield DONE_EVENT
    except asyncio.CancelledError:
        status = "499"  # the client went away; closing ``chunks`` below cancels the request
        raise
    finally:
        state.metrics.output_tokens.inc(completion.num_output_tokens)
        state.metrics.e2e.observe(time.perf_counter() - arrival)
        state.metrics.requests.labels(endpoint, status).inc()
        state.metrics.in_flight.dec()
        await chunks.aclose()
