"""``POST /v1/chat/completions`` and ``POST /v1/completions``: validate, tokenize once, dispatch,
answer whole or as SSE.

``n`` > 1: the first sequence is routed as usual; once its first token is out (its prompt's KV is in its
decode worker's prefix cache), the others start on that worker over those cached blocks, each with seed
+ i where a seed is given (as vLLM does), and their chunks are merged into one response.

The first worker chunk is awaited before any response starts, so a request that fails before its
first token (bad input a worker caught, no capacity, a failed transfer) gets a proper HTTP status;
later failures end the stream with an error event and ``[DONE]`` (a decode worker that dies is failed
over by the dispatcher first: router/dispatch.py). A client that goes away cancels the request on every
worker it touched, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from router.errors import WORKER_ERROR_STATUS, APIError, error_responses
from router.responses import DONE_EVENT, Completion, Echo, error_event, likeliest, response_body, usage_event
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.slo_window import RequestTrace
from router.sse import EventStreamResponse, until_disconnect
from router.state import RouterState
from router.tool_calls import ToolPlan, tool_plan
from workers.protocol.errors import InvalidRequestError
from workers.protocol.messages import TokenChunk
from workers.protocol.sampling_params import SamplingParams, check_fits

api = APIRouter(responses=error_responses(404, 429, 503))
# A completion: one JSON object, or with "stream": true server-sent events (OpenAI's chunks, then [DONE]).
_COMPLETION: dict[int | str, dict[str, Any]] = {200: {
    "description": "The completion, or its chunks as server-sent events",
    "content": {"application/json": {}, "text/event-stream": {}}}}

# Tokenizing a huge string takes long; beyond this many characters per allowed token it cannot fit.
_MAX_CHARS_PER_TOKEN = 32


@api.post("/v1/chat/completions", response_model=None, responses=_COMPLETION)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _serve(request, body, "chat")


@api.post("/v1/completions", response_model=None, responses=_COMPLETION)
async def completions(body: CompletionRequest, request: Request) -> Response:
    return await _serve(request, body, "completion")


def _tokenize(state: RouterState, body: ChatCompletionRequest | CompletionRequest, max_model_len: int,
              tools: ToolPlan | None) -> list[int]:
    tok = state.tokenizer
    if isinstance(body, ChatCompletionRequest):
        messages = body.message_dicts()
        if sum(len(m["content"]) for m in messages) > max_model_len * _MAX_CHARS_PER_TOKEN:
            raise InvalidRequestError(f"the messages are far longer than max_model_len {max_model_len} tokens")
        return tok.apply_chat_template(messages, tools.tools if tools is not None else None)
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
              max_model_len: int, tools: ToolPlan | None) -> SamplingParams:
    requested = body.requested_max_tokens
    if requested is None:  # as vLLM: until EOS or the model's length (KV grows as tokens come)
        requested = max(1, max_model_len - num_prompt_tokens)  # a full prompt fails the length check
    check_fits(num_prompt_tokens, requested, max_model_len)
    prompt_logprobs = None
    if isinstance(body, ChatCompletionRequest):
        logprobs, top = body.logprobs, body.top_logprobs or 0
    else:
        logprobs, top = body.logprobs is not None, body.logprobs or 0
        prompt_logprobs = body.logprobs if body.echo else None
    return SamplingParams(max_tokens=requested, temperature=body.temperature, top_p=body.top_p,
                          top_k=body.top_k, min_p=body.min_p, seed=body.seed, stop=body.stop_strings(),
                          stop_token_ids=list(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
                          logprobs=logprobs, top_logprobs=top, skip_special_tokens=body.skip_special_tokens,
                          presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                          repetition_penalty=body.repetition_penalty, logit_bias=body.logit_bias_pairs(),
                          min_tokens=body.min_tokens, json_schema=body.json_schema(),
                          structural_tag=tools.structural_tag if tools is not None else None,
                          prompt_logprobs=prompt_logprobs)


async def _serve(request: Request, body: ChatCompletionRequest | CompletionRequest, kind: str) -> Response:
    """Counts the request; a stream is counted by ``_stream`` when it ends."""
    state: RouterState = request.app.state.router
    endpoint = request.scope["path"]  # not request.url: building a URL costs ~50 us
    state.metrics.in_flight.inc()
    status = "500"
    response: Response | None = None
    trace = RequestTrace(time.perf_counter())
    try:
        response = await _respond(request, state, body, kind, trace)
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
            state.end_request(trace, status)


async def _respond(request: Request, state: RouterState, body: ChatCompletionRequest | CompletionRequest,
                   kind: str, trace: RequestTrace) -> Response:
    state.require_model(body.model)
    shape = state.cluster_shape()
    tools = tool_plan(body, state.tokenizer) if isinstance(body, ChatCompletionRequest) else None
    prompt_ids = _tokenize(state, body, shape.max_model_len, tools)
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty")
    sampling = _sampling(body, len(prompt_ids), shape.max_model_len, tools)
    if any(t >= state.tokenizer.vocab_size for t, _ in sampling.logit_bias):
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {state.tokenizer.vocab_size})")
    request_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
    trace.prompt_tokens = len(prompt_ids)
    state.slo.arrived(len(prompt_ids))
    num_sequences, shown_logprobs = body.num_sequences, sampling.logprobs
    if num_sequences > body.n:  # best_of: ranked by their tokens' log probabilities, which workers send
        sampling = replace(sampling, logprobs=True)
    echo = _echo(body, prompt_ids, state) if isinstance(body, CompletionRequest) else None
    choices = [Completion(kind, request_id, state.model_name, shown_logprobs, index=i, tools=tools, echo=echo)
               for i in range(num_sequences)]
    dispatcher, salt, block_size = state.dispatcher, body.cache_salt, shape.block_size
    route = dispatcher.plan(prompt_ids, salt, block_size, local_prefill=sampling.prompt_logprobs is not None,
                            cache_key=body.prompt_cache_key)
    streams = [dispatcher.generate(prompt_ids, sampling, salt, block_size, route)]
    firsts, gone = await until_disconnect(request.receive, _first_chunks(streams))
    if not gone and firsts is not None and num_sequences > 1:  # the prompt is cached on the decode worker now
        follow = dispatcher.follow(route, prompt_ids, block_size)
        more = [dispatcher.generate(prompt_ids, _choice_sampling(sampling, i), salt, block_size, follow)
                for i in range(1, num_sequences)]
        streams += more
        try:
            rest, gone = await until_disconnect(request.receive, _first_chunks(more))
        except BaseException:  # another sequence failed to start: the first one goes too
            await _close_all(streams)
            raise
        firsts = None if rest is None else firsts + rest
    if gone or firsts is None:  # the client left before the first token: cancel the request
        await _close_all(streams)
        return Response(status_code=499)
    trace.first_token_at = time.perf_counter()
    trace.queue_s = firsts[0].queue_seconds or 0.0
    state.metrics.ttft.observe(trace.first_token_at - trace.arrival)
    merged = _merge(list(zip(firsts, streams, strict=True)), state.metrics.tokens_arrived)
    if body.stream:
        return EventStreamResponse(_stream(state, choices, merged, body.include_usage, trace,
                                           request.scope["path"]), headers={"Cache-Control": "no-cache"},
                                   stall_timeout_s=state.config.client_stall_timeout_s,
                                   on_stall=state.metrics.stalled_clients.inc)
    collected, gone = await until_disconnect(request.receive, _collect(choices, merged))
    if gone or collected is None:
        await merged.aclose()
        return Response(status_code=499)
    state.metrics.output_tokens.inc(sum(c.num_output_tokens for c in choices))
    state.metrics.e2e.observe(time.perf_counter() - trace.arrival)
    trace.output_tokens, trace.ok = max(c.num_output_tokens for c in choices), True
    return JSONResponse(response_body(likeliest(choices, body.n), state.tokenizer, choices))


def _echo(body: CompletionRequest, prompt_ids: list[int], state: RouterState) -> Echo | None:
    if not body.echo:
        return None
    prompt = body.prompt
    text = prompt if isinstance(prompt, str) else state.tokenizer.decode(prompt_ids, skip_special_tokens=False)
    return Echo(text, prompt_ids, body.prompt_only)


def _choice_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s settings: its own seed (seed + index) where the request gives one."""
    return sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + index)


async def _close_all(streams: list[AsyncGenerator[TokenChunk, None]]) -> None:
    for stream in streams:
        await stream.aclose()


async def _first_chunks(streams: list[AsyncGenerator[TokenChunk, None]]) -> list[TokenChunk]:
    """Each stream's first chunk, together; on any failure every stream is closed and the error raised."""
    try:
        return list(await asyncio.gather(*(_first_chunk(s) for s in streams)))
    except BaseException:
        await _close_all(streams)
        raise


async def _merge(streams: list[tuple[TokenChunk, AsyncGenerator[TokenChunk, None]]],
                 on_tokens: Callable[[float, int], None]) -> AsyncGenerator[tuple[int, TokenChunk | APIError], None]:
    """Every choice's chunks as they come, each with its choice's index; a stream that breaks mid-way (the
    worker went away) gives its ``APIError`` as its last item. Closing this closes every stream.
    ``on_tokens(gap_s, n)``: a chunk of n tokens came gap_s after its stream's previous one (ITL)."""
    if len(streams) == 1:  # one choice: no task or queue in its path
        first, chunks = streams[0]
        timed = _timed(chunks, on_tokens)
        try:
            yield 0, first
            async for chunk in timed:
                yield 0, chunk
        except APIError as e:
            yield 0, e
        finally:
            await timed.aclose()
            await chunks.aclose()
        return
    queue: asyncio.Queue[tuple[int, TokenChunk | APIError | None]] = asyncio.Queue()

    async def pump(index: int, first: TokenChunk, chunks: AsyncGenerator[TokenChunk, None]) -> None:
        timed = _timed(chunks, on_tokens)
        try:
            queue.put_nowait((index, first))
            async for chunk in timed:
                queue.put_nowait((index, chunk))
        except APIError as e:
            queue.put_nowait((index, e))
        finally:
            await timed.aclose()
            await chunks.aclose()
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, first, chunks)) for i, (first, chunks) in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if item is None:
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _timed(chunks: AsyncGenerator[TokenChunk, None], on_tokens: Callable[[float, int], None]
                 ) -> AsyncGenerator[TokenChunk, None]:
    """The chunks after a stream's first, each one's tokens reported with the wait since the one before."""
    last = time.perf_counter()
    async for chunk in chunks:
        now = time.perf_counter()
        if chunk.token_ids:
            on_tokens(now - last, len(chunk.token_ids))
            last = now
        yield chunk


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


async def _collect(choices: list[Completion],
                   merged: AsyncGenerator[tuple[int, TokenChunk | APIError], None]) -> list[Completion]:
    async with contextlib.aclosing(merged):
        async for index, item in merged:
            if isinstance(item, APIError):
                raise item
            if item.error is not None:
                raise _worker_error(item)
            choices[index].add(item)
    return choices


async def _stream(state: RouterState, choices: list[Completion],
                  merged: AsyncGenerator[tuple[int, TokenChunk | APIError], None], include_usage: bool,
                  trace: RequestTrace, endpoint: str) -> AsyncIterator[str]:
    tok = state.tokenizer
    status = "200"
    try:
        if choices[0].kind == "chat":
            for choice in choices:
                yield choice.role_event()
        async for index, item in merged:
            error = item if isinstance(item, APIError) else _worker_error(item) if item.error is not None else None
            if error is not None:  # a worker failed, or went away mid-stream
                status = str(error.status)
                yield error_event(error.status, error.message, error.code)
                break
            assert isinstance(item, TokenChunk)
            choices[index].add(item)
            event = choices[index].delta_event(tok, item)
            if event is not None:
                yield event
        if include_usage and status == "200":
            yield usage_event(choices)
        yield DONE_EVENT
    except asyncio.CancelledError:
        status = "499"  # the client went away; closing ``merged`` below cancels the request everywhere
        raise
    finally:
        state.metrics.output_tokens.inc(sum(c.num_output_tokens for c in choices))
        state.metrics.e2e.observe(time.perf_counter() - trace.arrival)
        state.metrics.requests.labels(endpoint, status).inc()
        state.metrics.in_flight.dec()
        trace.output_tokens, trace.ok = max(c.num_output_tokens for c in choices), status == "200"
        state.end_request(trace, status)
        await merged.aclose()
