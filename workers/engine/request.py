"""A request's state inside one engine: tokens, progress, status and outputs."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from workers.protocol.block_hash import hash_prompt_blocks
from workers.protocol.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    # Blocks reserved, the prompt's KV being computed by a prefill worker (disaggregated serving).
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    # Never admitted: it waited past the queue's time bound (the caller hears "overloaded", not a finish).
    FINISHED_SHED = "shed"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
             RequestStatus.FINISHED_SHED}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    queue_seconds: float | None = None  # arrival to first admission
    status: RequestStatus = RequestStatus.WAITING
    # Prompt + generated tokens; the last one may not be computed yet (its KV comes next step).
    token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # With sampling_params.prompt_logprobs: prompt token i + 1's log probability and the likeliest
    # alternatives there, filled chunk by chunk as the prompt is computed (a recompute adds nothing).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # Tokens whose KV is stored in this engine's cache.
    num_computed_tokens: int = 0
    # Prompt tokens served from the prefix cache at (first) admission; a metric. -1: never admitted yet.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Matched stop string or stop token id, when status is FINISHED_STOPPED.
    stop_reason: str | int | None = None
    # Prefill worker side: keep the blocks after the first token until their KV has been sent.
    hold_blocks_on_finish: bool = False
    # Decode worker side: reserve blocks for the whole prompt; its KV and first token arrive from outside.
    remote_prefill: bool = False
    # Structured output: the xgrammar matcher of this request's schema (its state: the tokens so far).
    grammar: Any = None
    _block_hashes: list[int] = field(default_factory=list)
    # Greedy with nothing else asked of the sampler (no logit adjustments, grammar or logprobs): a batch of
    # only such rows samples by one argmax (the runner's fast path; most chats at temperature 0), and on a
    # GPU its decode steps overlap the host's work (Engine.step).
    plain_greedy: bool = field(init=False)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        p = self.sampling_params
        self.plain_greedy = (p.is_greedy and not p.adjusts_logits and not p.has_grammar and not p.logprobs
                             and not p.top_logprobs and p.prompt_logprobs is None)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt runs whole, with logits everywhere."""
        wanted = self.sampling_params.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < self.num_prompt_tokens - 1

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.is_finished else None

    def block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes of every full block of ``token_ids``, extended as the request grows."""
        if len(self._block_hashes) < self.num_tokens // block_size:
            self._block_hashes = hash_prompt_blocks(
                self.token_ids, block_size, self.cache_salt, self._block_hashes
            )
        return self._block_hashes

    def append_output_token(self, token_id: int, logprob: float | None,
                            top_logprobs: list[tuple[int, float]] | None = None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)
