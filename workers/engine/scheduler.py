"""Iteration-level continuous batching under a token budget (no prefill/decode phases).

Each step: running requests first (decodes, then unfinished prefill chunks), each taking
``num_tokens - num_computed_tokens`` capped by the chunk size and the remaining budget; then
waiting requests in arrival order, each admitted only if its blocks can be reserved. When the pool
runs short for a running request, the newest running request is preempted (its blocks freed, its
progress recomputed later, usually from the prefix cache) and the allocation retried.

Disaggregated serving adds two twists. On a decode worker a ``remote_prefill`` request is admitted
like any other, but its blocks are reserved for the whole prompt at once and it parks in
``awaiting_kv`` (outside the batch, never preempted) until ``commit_remote_kv`` brings its KV and first
token. On a prefill worker a ``hold_blocks_on_finish`` request keeps its blocks in ``held`` after
finishing, until the KV has been sent (``release_held``).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from workers.engine.config import EngineConfig
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import Request, RequestStatus


class ScheduledChunk(NamedTuple):
    request: Request
    num_new_tokens: int
    block_ids: list[int]  # the request's block table after this step's allocation (the runner reads it)

    @property
    def samples(self) -> bool:
        """The chunk reaches the request's last token, so the step samples a new one."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class KVReservation:
    """Blocks a decode worker reserved for a ``remote_prefill`` request.

    ``block_ids`` cover the whole prompt; the first ``num_cached_tokens // block_size`` already hold
    this worker's prefix cache, so only the rest need KV from the prefill worker.
    """

    request_id: str
    block_ids: list[int]
    num_cached_tokens: int


class SampledToken(NamedTuple):
    token_id: int
    logprob: float | None
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), likeliest first


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # remote_prefill requests whose blocks were reserved this step (now in awaiting_kv).
    kv_reserved: list[KVReservation] = field(default_factory=list)
    # Never-admitted requests that waited past max_queue_time_s (finished as FINISHED_SHED).
    shed: list[Request] = field(default_factory=list)
    # Seconds each request admitted for the first time this step waited in the queue.
    queue_seconds: list[float] = field(default_factory=list)
    # A step planned before the previous one's tokens were read (``Scheduler.schedule_follow_on``): per chunk,
    # the previous step's row whose sampled token is its input, or -1 (a request that joined since: its own
    # next token). None: inputs are the requests' own tokens.
    fed_from: list[int] | None = None

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(c.num_new_tokens == 1 for c in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, kv_cache: KVCacheManager, max_model_len: int, eos_token_id: int | None,
                 token_budget: int):
        self.config = config
        self.token_budget = token_budget  # tokens a step computes at most (config.max_num_batched_tokens resolved)
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.awaiting_kv: dict[str, Request] = {}
        self.held: dict[str, Request] = {}
        # Preemptions by what ran the pool dry: a running request's next token ("decode") or a prompt chunk.
        self.preemptions_by_cause: Counter[str] = Counter()
        self.num_prefix_hit_tokens_total = 0
        self.num_prefix_query_tokens_total = 0  # prompt tokens looked up in the prefix cache (hits + misses)
        self.num_prefill_tokens_total = 0

    @property
    def has_unfinished(self) -> bool:
        """Work that steps can advance (requests awaiting remote KV wait for ``commit_remote_kv``)."""
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length, aborted) and give back its blocks."""
        assert status.is_finished
        if request.status.is_finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING_FOR_KV:
            del self.awaiting_kv[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = status
        del self.requests[request.request_id]
        # A prefill that produced its token keeps its blocks for the transfer; an aborted or shed one has
        # nothing to send.
        if request.hold_blocks_on_finish and status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            self.held[request.request_id] = request
        else:
            self.kv_cache.free(request)

    def abort_request(self, request_id: str) -> Request | None:
        """Abort a live request, or release a finished one's held blocks."""
        request = self.requests.get(request_id)
        if request is not None:
            self.finish_request(request, RequestStatus.FINISHED_ABORTED)
            return request
        return self.release_held(request_id)

    def release_held(self, request_id: str) -> Request | None:
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv_cache.free(request)
        return request

    def commit_remote_kv(self, request_id: str, token: SampledToken) -> Request | None:
        """The prompt's KV has landed in the reserved blocks: join the batch with the first token."""
        request = self.awaiting_kv.pop(request_id, None)
        if request is None:
            return None  # aborted meanwhile
        request.remote_prefill = False  # a later preemption recomputes locally
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv_cache.cache_full_blocks(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        request.append_output_token(token.token_id, token.logprob, token.top_logprobs)
        status = self._check_stop(request)
        if status is not None:
            self.finish_request(request, status)
        return request

    # ---- schedule ----
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.max_queue_time_s is not None and self.waiting:
            self._shed_overdue(out, self.config.max_queue_time_s, time.monotonic())
        limit = self.token_budget
        decodes_first = sorted(self.running, key=lambda r: len(r.token_ids) - r.num_computed_tokens != 1)
        num_scheduled = 0  # tokens in out.chunks, kept as they are added (summing them per request was n^2)
        for request in decodes_first:
            budget = limit - num_scheduled
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            # A decode (one token left to compute) needs no chunking: most rows, every step.
            num_new = 1 if len(request.token_ids) - request.num_computed_tokens == 1 else self._chunk_len(
                request, budget)
            num_preempted = len(out.preempted)
            if self._reserve_or_preempt(request, num_new, out):
                out.chunks.append(ScheduledChunk(request, num_new, self.kv_cache.block_ids(request.request_id)))
            # A preemption may have taken an earlier chunk of this step away: count again then (rare).
            num_scheduled = out.num_batched_tokens if len(out.preempted) > num_preempted else num_scheduled + num_new
        if not out.preempted:
            self._admit_waiting(out, limit - num_scheduled)
        return out

    def schedule_follow_on(self, prev: SchedulerOutput) -> SchedulerOutput | None:
        """The decode step after ``prev``, planned while ``prev``'s tokens are still on the GPU, so it can be
        queued behind ``prev`` and the GPU never waits for the host between them (SGLang's overlap
        scheduling). ``prev`` is a decode-only step whose rows all sample, not yet passed to
        ``update_from_output``. Each row still running goes on, with ``prev``'s token as its input, unless
        max_tokens or the model's length ends it with that token; a row that token ends otherwise (EOS, a
        stop id, a stop string) computes one token more, which ``update_from_output`` drops (the request is
        finished by then). A request that joined since ``prev`` with its next token known (a remote prefill's
        commit) decodes in the step too. None where only a full ``schedule`` will do: a request may be admitted
        or shed, one has prompt left to compute, or the pool is short (a full schedule preempts)."""
        if self.waiting and (len(self.running) + len(self.awaiting_kv) < self.config.max_num_seqs
                             or self.config.max_queue_time_s is not None):
            return None
        chunks: list[ScheduledChunk] = []
        fed_from: list[int] = []
        num_running = 0
        for row, chunk in enumerate(prev.chunks):
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted, or finished by a stop string found after prev was planned
            num_running += 1
            if (len(request.output_token_ids) + 1 >= request.sampling_params.max_tokens
                    or request.num_tokens + 1 >= self.max_model_len):
                continue  # prev's token is its last
            # Room for prev's token (not yet counted in num_computed_tokens) and this step's.
            if not self.kv_cache.allocate_slots(request, 2):
                return None
            chunks.append(ScheduledChunk(request, 1, self.kv_cache.block_ids(request.request_id)))
            fed_from.append(row)
        if num_running < len(self.running):  # requests joined since prev
            in_prev = {id(c.request) for c in prev.chunks}
            for request in self.running:
                if id(request) in in_prev:
                    continue
                if request.num_tokens - request.num_computed_tokens != 1 or not self.kv_cache.allocate_slots(
                        request, 1):
                    return None
                chunks.append(ScheduledChunk(request, 1, self.kv_cache.block_ids(request.request_id)))
                fed_from.append(-1)
        if not chunks or len(chunks) > self.token_budget:
            return None
        return SchedulerOutput(chunks=chunks, fed_from=fed_from)

    def _chunk_len(self, request: Request, budget: int) -> int:
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        chunk = self.config.prefill_chunk_size
        return min(num_new, chunk) if chunk else num_new

    def _shed_overdue(self, out: SchedulerOutput, bound: float, now: float) -> None:
        """Shed never-admitted requests that waited past the bound. They queue in arrival order (preempted
        ones, already admitted once and never shed, sit at the head), so the walk stops at the first one
        still in time."""
        for request in self.waiting:
            if request.num_cached_tokens >= 0:
                continue  # preempted: it was admitted once and keeps its place
            if now - request.arrival_time <= bound:
                break
            out.shed.append(request)
        for request in out.shed:
            self.finish_request(request, RequestStatus.FINISHED_SHED)

    def _reserve_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        cause = "decode" if num_new == 1 else "prefill_chunk"
        while not self.kv_cache.allocate_slots(request, num_new):
            victim = self.running[-1]
            self.preemptions_by_cause[cause] += 1
            self._preempt(victim)
            out.preempted.append(victim)
            # The newest request may already hold a chunk of this step (a decode scheduled first).
            out.chunks = [c for c in out.chunks if c.request is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit from the head of the queue, first come first served, with one exception: a request
        whose next block another request is computing right now waits (others pass it) until that
        block is cached, then reuses it instead of computing the same prefix twice."""
        if not self.waiting:
            return  # the common decode-only step: no walk over the running requests' blocks
        track = self.kv_cache.pool.enable_prefix_caching
        in_flight = self._blocks_in_prefill() if track else set()
        now = time.monotonic()
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) + len(self.awaiting_kv) < self.config.max_num_seqs:
            request = self.waiting[0]
            computed_blocks, num_cached = self.kv_cache.get_computed_blocks(request)
            if in_flight and self._next_block_in_flight(request, num_cached, in_flight):
                deferred.append(self.waiting.popleft())
                continue
            request.num_computed_tokens = num_cached
            remote = request.remote_prefill
            num_new = request.num_tokens - num_cached if remote else self._chunk_len(request, budget)
            # Admit only with a block of growth left for each running request, else the next decode
            # step would preempt the newcomer and throw its prefill away.
            if not self.kv_cache.allocate_slots(request, num_new, computed_blocks, keep_free=len(self.running)):
                request.num_computed_tokens = 0
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                self.num_prefix_hit_tokens_total += num_cached
                self.num_prefix_query_tokens_total += request.num_tokens
                request.queue_seconds = now - request.arrival_time
                out.queue_seconds.append(request.queue_seconds)
            if remote:  # no compute here: the blocks wait for the prefill worker's KV
                request.status = RequestStatus.WAITING_FOR_KV
                self.awaiting_kv[request.request_id] = request
                out.kv_reserved.append(KVReservation(
                    request.request_id, self.kv_cache.block_ids(request.request_id), num_cached))
                continue
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            out.chunks.append(ScheduledChunk(request, num_new, self.kv_cache.block_ids(request.request_id)))
            budget -= num_new
            if track:
                in_flight |= self._uncomputed_prompt_blocks(request)
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order

    def _uncomputed_prompt_blocks(self, request: Request) -> set[int]:
        bs = self.kv_cache.block_size
        hashes = request.block_hashes(bs)[: request.num_prompt_tokens // bs]
        return set(hashes[request.num_computed_tokens // bs :])

    def _blocks_in_prefill(self) -> set[int]:
        """Hashes of full prompt blocks that running requests have yet to compute."""
        out: set[int] = set()
        for request in self.running:
            if request.num_computed_tokens < request.num_prompt_tokens:
                out |= self._uncomputed_prompt_blocks(request)
        return out

    def _next_block_in_flight(self, request: Request, num_cached: int, in_flight: set[int]) -> bool:
        hashes = request.block_hashes(self.kv_cache.block_size)
        index = num_cached // self.kv_cache.block_size
        return index < len(hashes) and hashes[index] in in_flight

    # ---- after the model ran ----
    def update_from_output(
        self, out: SchedulerOutput, sampled: Iterable[SampledToken | None]
    ) -> list[Request]:
        """Advance progress, append sampled tokens, retire finished requests.

        Returns the requests that received a token this step (finished ones included).
        """
        updated: list[Request] = []
        for chunk, token in zip(out.chunks, sampled, strict=True):
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            n = chunk.num_new_tokens
            if n > 1 or not request.output_token_ids:
                self.num_prefill_tokens_total += n
            request.num_computed_tokens += n
            self.kv_cache.cache_full_blocks(request)
            if token is None:
                continue
            request.append_output_token(token.token_id, token.logprob, token.top_logprobs)
            updated.append(request)
            status = self._check_stop(request)
            if status is not None:
                self.finish_request(request, status)
        return updated

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last == self.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens or len(request.token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
