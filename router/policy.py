"""Routing policies as pure functions: views of the workers in, a worker id out.

Prefix-aware prefill choice (Dynamo's cost, in blocks):

    cost(w) = w_prefill × (prompt blocks − overlap(w) + queued prefill blocks(w)) + w_load × (running + waiting)(w)

Costs within ``prefix_affinity`` × the prompt's blocks of the best count as a tie, and a tie goes to
the worker holding the longest prefix: moving a request off the worker that caches its prefix only
pays when it is clearly faster, since the new worker must recompute (and cache, evicting others)
that prefix, which sets off the same trade for the next request. Remaining ties go to the worker
caching the fewest blocks (so new prefixes spread over the pool's cache instead of piling onto one
worker and evicting each other), then by ``tie_key`` (the prompt's first block hash): random across
prefixes, yet the same on every router replica, so routers that see the same state make the same
choice and a prefix nobody caches yet lands on one worker from every router.

Decode choice: first the requests that would wait ahead of this one, then the running batch; but a decode
worker that caches the prompt's prefix (a conversation's earlier turns, prompt and answers) keeps the request
while its batch is at most ``decode_affinity_slack`` bigger than the best's (scaled by the share of the prompt
it holds): there the prompt is prefilled locally, or only the blocks it lacks are moved, where another worker
needs the whole prompt's KV.

A client's ``prompt_cache_key`` (OpenAI's routing hint for requests that share prompts) orders the workers by
rendezvous hashing, the same order on every router: where the cache and load leave a choice (a tie in cost
and cached prefix for prefill; for decode, the longest cached prefix's holders within the slack, or where none
caches any of the prompt, every worker within the slack), the first in the key's order takes the request, so
a conversation's first turn lands where its later ones will look. (Under the other policies the key's hash
is the tie key: dispatch.py.)
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

POLICIES = ("prefix_aware", "round_robin", "least_loaded")
# PolicyConfig's fields that only prefix_aware reads: round_robin and least_loaded neither cost prompts nor
# prefill locally nor keep a conversation on its decode worker.
PREFIX_AWARE_KNOBS = ("prefill_weight", "load_weight", "local_prefill_max_tokens", "local_prefill_min_overlap",
                      "prefix_affinity", "decode_affinity_slack")


@dataclass(frozen=True)
class Route:
    """A routing decision: which workers serve one request."""

    decode_worker: str
    prefill_worker: str | None  # None: prefill on the decode worker
    prefill_overlap_blocks: int  # cached leading blocks on the worker that prefills
    kv_blocks_needed: int  # the prompt's blocks, reserved on the decode worker (decode grows them later)
    cache_key: str | None = None  # the client's prompt_cache_key: a failover routes by it too


@dataclass(frozen=True)
class PolicyConfig:
    policy: str = "prefix_aware"
    prefill_weight: float = 1.0
    load_weight: float = 1.0
    # Prefill on the decode worker when at most this many prompt tokens are not cached there ...
    local_prefill_max_tokens: int = 64
    # ... or when the decode worker already holds at least this share of the prompt (multi-turn).
    local_prefill_min_overlap: float = 0.8
    # Cost margin (a share of the prompt's blocks) within which the longest cached prefix wins.
    prefix_affinity: float = 0.25
    # Requests more than the least busy decode worker's batch that one caching the prompt's prefix (or first in
    # the prompt_cache_key's order) may run and still take the request.
    decode_affinity_slack: int = 4

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.prefill_weight < 0 or self.load_weight < 0 or self.prefix_affinity < 0:
            raise ValueError("policy weights must be non-negative")
        if self.decode_affinity_slack < 0:
            raise ValueError("decode_affinity_slack must be non-negative")
        unread = self.unread_knobs()
        if unread:  # set, and read by no one: refused rather than ignored
            raise ValueError(f"{', '.join(unread)}: only the prefix_aware policy reads this, and the policy is "
                             f"{self.policy} (leave it at its default, or use prefix_aware)")

    def unread_knobs(self) -> list[str]:
        """The prefix_aware knobs set away from their defaults under another policy, which would not read them."""
        if self.policy == "prefix_aware":
            return []
        defaults = {f.name: f.default for f in fields(PolicyConfig)}
        return [k for k in PREFIX_AWARE_KNOBS if getattr(self, k) != defaults[k]]


class WorkerView(NamedTuple):
    """What the router knows of one worker when it decides (reported load plus its own dispatches)."""

    worker_id: str
    num_running: int
    num_waiting: int
    queued_prefill_tokens: int
    kv_blocks_free: int
    # Blocks the worker's events say it caches (a tie-breaker: spread prefixes over the caches).
    cached_blocks: int = 0


def _pick(worker_ids: Sequence[str], tie_key: int) -> str:
    return sorted(worker_ids)[tie_key % len(worker_ids)]


def key_rank(cache_key: str, worker_id: str) -> int:
    """Where ``cache_key`` puts a worker (higher first): rendezvous hashing, so every router agrees, and a worker
    joining or leaving moves only the keys it comes first for."""
    digest = hashlib.blake2b(f"{cache_key}\0{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _first_for_key(views: Sequence[WorkerView], cache_key: str) -> str:
    return max(views, key=lambda v: key_rank(cache_key, v.worker_id)).worker_id


def prefill_cost(view: WorkerView, num_prompt_blocks: int, overlap_blocks: int, block_size: int,
                 config: PolicyConfig) -> float:
    queued_blocks = view.queued_prefill_tokens / block_size
    to_compute = num_prompt_blocks - overlap_blocks + queued_blocks
    return config.prefill_weight * to_compute + config.load_weight * (view.num_running + view.num_waiting)


def choose_prefill_worker(views: Sequence[WorkerView], overlaps: Mapping[str, int], num_prompt_blocks: int,
                          block_size: int, config: PolicyConfig, tie_key: int, cache_key: str | None = None) -> str:
    """argmin of ``prefill_cost``; ties to the longest cached prefix, then ``cache_key``'s first (or the least
    cached, then ``tie_key``)."""
    if not views:
        raise ValueError("no prefill workers")
    costs = {v.worker_id: prefill_cost(v, num_prompt_blocks, overlaps.get(v.worker_id, 0), block_size, config)
             for v in views}
    margin = config.prefill_weight * config.prefix_affinity * num_prompt_blocks + 1e-9
    best = min(costs.values())
    tied = [v for v in views if costs[v.worker_id] <= best + margin]
    longest = max(overlaps.get(v.worker_id, 0) for v in tied)
    tied = [v for v in tied if overlaps.get(v.worker_id, 0) == longest]
    if cache_key is not None:
        return _first_for_key(tied, cache_key)
    least_cached = min(v.cached_blocks for v in tied)
    return _pick([v.worker_id for v in tied if v.cached_blocks == least_cached], tie_key)


def choose_least_loaded(views: Sequence[WorkerView], tie_key: int) -> str:
    """Fewest requests in flight, then fewest queued prefill tokens."""
    if not views:
        raise ValueError("no workers")
    best = min((v.num_running + v.num_waiting, v.queued_prefill_tokens) for v in views)
    return _pick([v.worker_id for v in views if (v.num_running + v.num_waiting, v.queued_prefill_tokens) == best],
                 tie_key)


def decode_rank(view: WorkerView, num_prompt_blocks: int) -> tuple[int, int, int]:
    """Lower is better. First the requests that would wait ahead of this one (the queue, plus this one
    if the prompt does not fit in the blocks left once each running request has grown by one: what the
    worker's scheduler keeps free before it admits more), then the running batch (its size sets the
    time per token), then the most blocks left."""
    room = view.kv_blocks_free - view.num_running
    return view.num_waiting + (room < num_prompt_blocks), view.num_running, -room


def choose_decode_worker(views: Sequence[WorkerView], num_prompt_blocks: int, tie_key: int,
                         overlaps: Mapping[str, int] | None = None, slack: int = 0,
                         cache_key: str | None = None) -> str:
    """Any live decode worker takes the request (a full one queues it): the best ranked. But a worker caching
    part of the prompt (``overlaps``, in blocks) that queues it no later may run up to ``slack`` requests more,
    in proportion to the share of the prompt it holds: the longest such prefix wins. With ``cache_key``, the
    first in its order among those (or, where none caches any, among all within ``slack``); else the best
    ranked (ties by ``tie_key``)."""
    if not views:
        raise ValueError("no decode workers")
    ranks = {v.worker_id: decode_rank(v, num_prompt_blocks) for v in views}
    best = min(ranks.values())
    overlaps = overlaps or {}

    def within(v: WorkerView, extra: float) -> bool:
        waits, running, _ = ranks[v.worker_id]
        return waits == best[0] and running <= best[1] + extra

    holders = [v for v in views if overlaps.get(v.worker_id, 0) > 0
               and within(v, slack * overlaps[v.worker_id] / max(num_prompt_blocks, 1))]
    if holders:
        longest = max(overlaps[v.worker_id] for v in holders)
        candidates = [v for v in holders if overlaps[v.worker_id] == longest]
    else:  # nothing cached yet: a key's first worker within the slack, where its later requests will look
        candidates = [v for v in views if within(v, slack if cache_key is not None else 0)]
    if cache_key is not None:
        return _first_for_key(candidates, cache_key)
    top = min(ranks[v.worker_id] for v in candidates)
    return _pick([v.worker_id for v in candidates if ranks[v.worker_id] == top], tie_key)


def should_prefill_locally(num_prompt_tokens: int, decode_overlap_tokens: int, config: PolicyConfig) -> bool:
    """Whether moving KV costs more than computing the rest of the prompt on the decode worker."""
    uncached = num_prompt_tokens - decode_overlap_tokens
    return (uncached <= config.local_prefill_max_tokens
            or decode_overlap_tokens >= config.local_prefill_min_overlap * num_prompt_tokens)


class RoundRobin:
    """The comparison baseline: each request to the next worker, ignoring caches and load."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, views: Sequence[WorkerView]) -> str:
        if not views:
            raise ValueError("no workers")
        ids = sorted(v.worker_id for v in views)
        choice = ids[self._next % len(ids)]
        self._next += 1
        return choice
