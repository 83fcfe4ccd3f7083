"""Wire messages between router, decode workers and prefill workers (msgpack).

The shared vocabulary of the cluster: the router imports these, workers answer with them. Each
message is a dataclass (fields may be dataclasses too, e.g. ``SamplingParams``, rebuilt as themselves);
``pack`` / ``unpack`` turn it into msgpack bytes and back, refusing unknown fields so a version skew
fails loudly instead of silently dropping data.

    router --GenerateRequest--> decode worker --PrefillRequest--> prefill worker
    router <--TokenChunk* ----- decode worker <--PrefillResult--- prefill worker
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from workers.protocol.sampling_params import SamplingParams

M = TypeVar("M")


def pack(message: Any) -> bytes:
    return msgpack.packb(_fields_dict(message), use_bin_type=True)


def unpack(cls: type[M], data: bytes) -> M:
    return _build(cls, msgpack.unpackb(data, raw=False))


def pack_list(messages: Sequence[Any]) -> bytes:
    """Several messages in one msgpack array (a decode step's chunks for one router)."""
    return msgpack.packb([_fields_dict(m) for m in messages], use_bin_type=True)


def _fields_dict(message: Any) -> dict[str, Any]:
    """A message's fields by name, a dataclass field as its own dict: what ``_build`` rebuilds. Not
    ``dataclasses.asdict``, which deep-copies every list (a decode step's 8 chunks: 94 us against 11)."""
    names, nested = _fields_of(type(message))  # type: ignore[arg-type]
    fields = {name: getattr(message, name) for name in names}
    for name in nested:
        if fields[name] is not None:
            fields[name] = _fields_dict(fields[name])
    return fields


def unpack_list(cls: type[M], data: bytes) -> list[M]:
    return [_build(cls, fields) for fields in msgpack.unpackb(data, raw=False)]


def _build(cls: type[M], fields: dict[str, Any]) -> M:
    names, nested = _fields_of(cls)  # type: ignore[arg-type]
    unknown = set(fields).difference(names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    for name, field_cls in nested.items():
        if fields.get(name) is not None:
            fields[name] = _build(field_cls, fields[name])
    return cls(**fields)


@functools.cache
def _fields_of(cls: type) -> tuple[tuple[str, ...], dict[str, type]]:
    """A message's field names in order, and those whose type is a dataclass (or one of them or None)."""
    hints = typing.get_type_hints(cls)
    nested: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
        for option in typing.get_args(hint) if union else (hint,):
            if dataclasses.is_dataclass(option) and isinstance(option, type):
                nested[f.name] = option
    return tuple(f.name for f in dataclasses.fields(cls)), nested


@dataclass
class GenerateRequest:
    """Router -> decode worker: one request, already tokenized."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None
    # The prefill worker to use (its id); None: prefill locally on the decode worker.
    prefill_worker: str | None = None
    # Failover: the output tokens the client already has (from a worker that died); decoding goes on after
    # them, prefilled here over the prompt and them. Chunks then carry only new tokens.
    resume_token_ids: list[int] = field(default_factory=list)


@dataclass
class PrefillRequest:
    """Decode worker -> prefill worker: compute this prompt and write its KV into my blocks."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
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
    top_logprobs: list[tuple[int, float]] | None = None  # the first token's, when asked for


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
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # per token: (id, logprob) pairs
    # First chunk, where asked for: each prompt token's (after the first) log probability and alternatives.
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    # First chunk: seconds the request waited on the decode worker before admission (KV blocks, a batch slot).
    queue_seconds: float | None = None


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
