"""OpenAI response bodies and stream chunks for chat and text completions, built from TokenChunks.

One ``Completion`` a choice (``n`` of them share the request's id); ``response_body`` and ``usage_event``
speak for all of a request's choices.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from router.tool_call_parser import ToolCallParser
from router.tool_calls import ToolPlan
from workers.model.tokenizer import Tokenizer
from workers.protocol.messages import TokenChunk


@dataclass(frozen=True)
class Echo:
    """``echo`` on a completion: the prompt comes first in the text (and, with logprobs, in the logprobs)."""

    text: str
    token_ids: list[int]
    prompt_only: bool  # max_tokens 0: the prompt alone (the worker's one token is not shown)


@dataclass
class Completion:
    """What one choice of a request produced so far; fed chunk by chunk."""

    kind: str  # "chat" or "completion"
    request_id: str
    model: str
    want_logprobs: bool
    index: int = 0  # the choice's place among the request's n
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it (null: EOS or length)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    tools: ToolPlan | None = None  # calls are read out of the text (chat with tools)
    echo: Echo | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    _stream_parser: ToolCallParser = field(default_factory=ToolCallParser, repr=False)
    _echoed: bool = False  # streamed: the prompt went out with the first chunk

    def add(self, chunk: TokenChunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        if self.echo is not None and self.echo.prompt_only:
            self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
            self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
            self.finish_reason = "length"
            return
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.top_logprobs.extend(chunk.top_logprobs)
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = chunk.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.finished:
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"
            self.stop_reason = chunk.stop_reason

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"


    def logprobs_of(self, tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                    tops: list[list[tuple[int, float]]], text_offset: int,
                    echoed: bool = False) -> dict[str, Any] | None:
        """``echoed``: the prompt's tokens come first (the first with no log probability: nothing precedes it)."""
        if not self.want_logprobs:
            return None

        def text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False)

        if echoed:
            return self._echoed_logprobs(tokenizer, token_ids, logprobs, tops)
        tokens = [text(t) for t in token_ids]
        alternatives = [[(text(t), lp) for t, lp in top] for top in tops] if tops else [[] for _ in tokens]
        if self.kind == "chat":
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")),
                                 "top_logprobs": [{"token": alt, "logprob": alp, "bytes": list(alt.encode("utf-8"))}
                                                  for alt, alp in top]}
                                for tok, lp, top in zip(tokens, logprobs, alternatives, strict=False)]}
        offsets, pos = [], text_offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": logprobs[: len(tokens)],
                "top_logprobs": [dict(top) for top in alternatives] if tops else None, "text_offset": offsets}

    def _finish_reason(self, called: bool) -> str | None:
        """OpenAI's: "tool_calls" where the model chose to call (a forced call ends with "stop")."""
        if called and self.finish_reason == "stop" and self.tools is not None and not self.tools.forced:
            return "tool_calls"
        return self.finish_reason

    def _echoed_logprobs(self, tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                         tops: list[list[tuple[int, float]]]) -> dict[str, Any]:
        """Completion logprobs with the prompt's first: [None, prompt token 1's, ...] then the output's."""
        assert self.echo is not None
        prompt = self.prompt_logprobs or []
        texts = [tokenizer.decode([t], skip_special_tokens=False) for t in self.echo.token_ids + token_ids]
        values: list[float | None] = [None] + [lp for lp, _ in prompt] + list(logprobs)
        alternatives: list[dict[str, float] | None] = [None] + [
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in top}
            for top in [top for _, top in prompt] + list(tops or [[] for _ in token_ids])]
        offsets, pos = [], 0
        for token in texts:
            offsets.append(pos)
            pos += len(token)
        return {"tokens": texts, "token_logprobs": values, "top_logprobs": alternatives, "text_offset": offsets}

    def choice(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """This choice, whole (not streamed)."""
        echoed = self.echo is not None
        logprobs = self.logprobs_of(tokenizer, self.token_ids, self.logprobs, self.top_logprobs, 0, echoed)
        if self.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": self.text}
            calls: list[dict[str, Any]] = []
            if self.tools is not None:
                parser = ToolCallParser()
                parser.feed(self.text)
                parser.finish()
                calls = parser.calls
                if calls:  # the text around the calls is whitespace, as the format puts it
                    message = {"role": "assistant", "content": parser.content if parser.content.strip() else None,
                               "tool_calls": calls}
            return {"index": self.index, "message": message, "logprobs": logprobs,
                    "finish_reason": self._finish_reason(bool(calls)), "stop_reason": self.stop_reason}
        text = self.echo.text + self.text if self.echo is not None else self.text
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason,
                "stop_reason": self.stop_reason}

    # ---- streaming ----
    def event(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        """One SSE event of this request's stream."""
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def role_event(self) -> str:
        return self.event([{"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_event(self, tokenizer: Tokenizer, chunk: TokenChunk) -> str | None:
        """The SSE event for one worker chunk (after ``add``), or None when it carries nothing to say."""
        finish = self.finish_reason if chunk.finished else None
        stop_reason = self.stop_reason if chunk.finished else None
        if self.echo is not None:
            return self._echo_delta_event(tokenizer, chunk, finish, stop_reason)
        if not chunk.text and finish is None and not (self.want_logprobs and chunk.token_ids):
            return None
        logprobs = self.logprobs_of(tokenizer, chunk.token_ids, chunk.logprobs, chunk.top_logprobs,
                                    len(self.text) - len(chunk.text))
        if self.kind == "chat":
            delta: dict[str, Any] = {"content": chunk.text} if chunk.text else {}
            if self.tools is not None:
                delta = self._tool_delta(chunk)
                finish = self._finish_reason(bool(self._stream_parser.calls)) if chunk.finished else None
                if not delta and finish is None and not (self.want_logprobs and chunk.token_ids):
                    return None
            return self.event([{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                                 "stop_reason": stop_reason}])
        return self.event([{"index": self.index, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish,
                             "stop_reason": stop_reason}])


    def _echo_delta_event(self, tokenizer: Tokenizer, chunk: TokenChunk, finish: str | None,
                          stop_reason: str | int | None) -> str | None:
        """A completion stream with ``echo``: the prompt (and its logprobs) go out with the first chunk."""
        assert self.echo is not None
        if self.echo.prompt_only:
            ids, text, values, tops = [], "", [], []
        else:
            ids, text, values, tops = chunk.token_ids, chunk.text, chunk.logprobs, chunk.top_logprobs
        first = not self._echoed
        self._echoed = True
        if not first and not text and finish is None and not (self.want_logprobs and ids):
            return None
        offset = len(self.echo.text) + len(self.text) - len(text)
        logprobs = self.logprobs_of(tokenizer, ids, values, tops, offset, echoed=first)
        return self.event([{"index": self.index, "text": self.echo.text + text if first else text,
                            "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}])

    def _tool_delta(self, chunk: TokenChunk) -> dict[str, Any]:
        """A chunk's text as the stream shows it: content, and each call whole once it has closed."""
        parser = self._stream_parser
        done = len(parser.calls)
        shown, calls = parser.feed(chunk.text)
        if chunk.finished:
            rest, last = parser.finish()
            shown, calls = shown + rest, calls + last
        delta: dict[str, Any] = {"content": shown} if shown else {}
        if calls:
            delta["tool_calls"] = [{"index": done + i, **call} for i, call in enumerate(calls)]
        return delta


def usage(choices: list[Completion]) -> dict[str, Any]:
    """The prompt once (and what the first choice found cached), the output tokens of every choice."""
    first = choices[0]
    completion_tokens = sum(c.num_output_tokens for c in choices)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": first.num_prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}


def likeliest(choices: list[Completion], n: int) -> list[Completion]:
    """best_of: the ``n`` sequences with the highest log probability per token (OpenAI's definition: a mean,
    so a longer sequence is not ranked down for its length), in that order and numbered again from 0; all
    of them where there are only ``n``."""
    if len(choices) == n:
        return choices
    ranked = sorted(choices, key=lambda c: sum(c.logprobs) / max(1, len(c.logprobs)), reverse=True)[:n]
    for index, choice in enumerate(ranked):
        choice.index = index
    return ranked


def response_body(choices: list[Completion], tokenizer: Tokenizer,
                  generated: list[Completion] | None = None) -> dict[str, Any]:
    """The whole, non-streamed response: ``choices``, and the usage of every sequence ``generated``
    (best_of's too: they were all decoded)."""
    first = choices[0]
    return {"id": first.request_id, "object": first.object, "created": first.created, "model": first.model,
            "choices": [c.choice(tokenizer) for c in choices], "usage": usage(generated or choices)}


def usage_event(choices: list[Completion]) -> str:
    return choices[0].event([], usage(choices))


def error_event(status: int, message: str, kind: str | None) -> str:
    """A failure after the stream began (the status line is already sent): an error event, then [DONE]."""
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": kind}}
    return f"data: {json.dumps(body)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
