"""Wire messages between router, decode workers and prefill workers (msgpack).

The shared vocabulary of the cluster: the router imports these, workers answer with them. Each
message is a flat dataclass; ``pack`` / ``unpack`` turn it into msgpack bytes and back, refusing
unknown fields so a version skew fails loudly instead of silently dropping data.

    router --GenerateRequest--> decode worker --PrefillRequest--> prefill worker
    router <--TokenChunk* ----- decode worker <--PrefillResult--- prefill worker
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from workers.protocol.sampling_params import SamplingParams

M = TypeVar("M")


def pack(message: Any) -> bytes:
    return msgpack.packb(dataclasses.asdict(message), use_bin_type=True)


def unpack(cls: type[M], data: bytes) -> M:
    fields = msgpack.unpackb(data, raw=False)
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(fields) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    return cls(**fields)


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def sampling_from_dict(fields: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**fields)


@dataclass
class GenerateRequest:
    """Router -> decode worker: one request, already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    cache_salt: str | None = None
    # The prefill worker to use (its id); None: prefill locally on the decode worker.
    prefill_worker: str | None = None


@dataclass
class PrefillRequest:
    """Decode worker -> prefill worker: compute this prompt and write its KV into my blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    cache_salt: str | None
    kv_destination: dict[str, Any]  # the decode worker's transport address
    dst_block_ids: list[int]  # the blocks to fill, in prompt order (after the skipped ones)
    num_skip_blocks: int  # leading prompt blocks the decode worker already holds
    timeout_s: float


@dataclass
class PrefillResult:
    request_id: str
    token_id: int
    logprob: float | None
    num_cached_tokens: int  # prompt tokens the prefill worker served from its prefix cache
    transfer_bytes: int
    transfer_seconds: float


@dataclass
class TokenChunk:
    """Decode worker -> router: new tokens of one request; the last one has ``finished`` set.

    ``error`` (with ``error_kind``: invalid_request, capacity, transfer, internal) ends a stream that
    failed; the router maps the kind to an HTTP status.
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    error_kind: str | None = None


@dataclass
class WorkerLoad:
    """A worker's load report (routers read these to weigh choices)."""

    worker_id: str
    role: str
    num_waiting: int
    num_running: int
    kv_blocks_used: int
    kv_blocks_total: int
    waiting_prefill_tokens: int
    prefix_cache_hit_tokens: int
    # Position of the worker's KV event stream when this was reported (see ``workers.service.publisher``):
    # a router whose index is behind it for long missed entries and reloads the snapshot.
    kv_events_epoch: int = 0
    kv_events_seq: int = 0
