"""OpenAI response bodies and stream chunks for chat and text completions, built from TokenChunks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from workers.model.tokenizer import Tokenizer
from workers.protocol.messages import TokenChunk


@dataclass
class Completion:
    """What one request produced so far; fed chunk by chunk."""

    kind: str  # "chat" or "completion"
    request_id: str
    model: str
    want_logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, chunk: TokenChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        self.num_prompt_tokens = chunk.num_prompt_tokens or self.num_prompt_tokens
        self.num_output_tokens = chunk.num_output_tokens or self.num_output_tokens
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if chunk.finished:
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"

    @property
    def object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_output_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}

    def logprobs_of(self, tokenizer: Tokenizer, token_ids: list[int], logprobs: list[float],
                    text_offset: int) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        if self.kind == "chat":
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8")), "top_logprobs": []}
                                for tok, lp in zip(tokens, logprobs, strict=False)]}
        offsets, pos = [], text_offset
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": logprobs[: len(tokens)], "top_logprobs": None,
                "text_offset": offsets}

    def body(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """The whole, non-streamed response."""
        logprobs = self.logprobs_of(tokenizer, self.token_ids, self.logprobs, 0)
        if self.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": self.text},
                                      "logprobs": logprobs, "finish_reason": self.finish_reason}
        else:
            choice = {"index": 0, "text": self.text, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    # ---- streaming ----
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                                "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def role_event(self) -> str:
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_event(self, tokenizer: Tokenizer, chunk: TokenChunk) -> str | None:
        """The SSE event for one worker chunk (after ``add``), or None when it carries nothing to say."""
        finish = self.finish_reason if chunk.finished else None
        if not chunk.text and finish is None and not (self.want_logprobs and chunk.token_ids):
            return None
        logprobs = self.logprobs_of(tokenizer, chunk.token_ids, chunk.logprobs, len(self.text) - len(chunk.text))
        if self.kind == "chat":
            delta = {"content": chunk.text} if chunk.text else {}
            return self._chunk([{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        return self._chunk([{"index": 0, "text": chunk.text, "logprobs": logprobs, "finish_reason": finish}])

    def usage_event(self) -> str:
        return self._chunk([], self.usage())


def error_event(status: int, message: str, kind: str | None) -> str:
    """A failure after the stream began (the status line is already sent): an error event, then [DONE]."""
    body = {"error": {"message": message, "type": "server_error" if status >= 500 else "invalid_request_error",
                      "param": None, "code": kind}}
    return f"data: {json.dumps(body)}\n\n"


DONE_EVENT = "data: [DONE]\n\n"
