"""Per request: pick the workers (policy over the live workers and the prefix index), stream the
decode worker's chunks, and keep the router's own account of what it sent where.

Load reports arrive every ~100 ms; a burst of requests lands between two reports. So the router
also counts what it dispatched itself (prompt tokens not yet prefilled, requests in flight, KV
blocks promised) and uses the larger of that and the report, and it tags the prompt's blocks on the
chosen workers as approximate prefix-index entries until the workers' own events arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, replace

from kernels.host_math import cdiv
from router.errors import APIError, no_worker_error
from router.metrics import RouterMetrics
from router.policy import (
    PolicyConfig,
    RoundRobin,
    Route,
    WorkerView,
    choose_decode_worker,
    choose_least_loaded,
    choose_prefill_worker,
    key_rank,
    should_prefill_locally,
)
from router.prefix_index import PrefixIndex
from router.worker_client import WorkerClient, WorkerUnreachable
from router.worker_directory import WorkerDirectory, WorkerEntry
from workers.protocol.block_hash import ROOT_HASH, hash_block, hash_prompt_blocks
from workers.protocol.errors import OVERLOADED_KINDS
from workers.protocol.messages import GenerateRequest, TokenChunk
from workers.protocol.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A remote prefill failing this way (transfer error, prefill worker gone, stopped or shedding load) is
# retried as a local prefill on the decode worker.
_RETRY_LOCALLY = ("transfer", "unavailable", *OVERLOADED_KINDS)
# A decode worker failing this way (its engine failed, it stopped, or a transfer to it broke) has its
# streams failed over, as has one that dies or cannot be reached ("unreachable").
_FAIL_OVER = ("internal", "unavailable", "transfer")
# How long a failover waits for a live decode worker other than those that failed (the controller
# replaces a dead one; a second worker may be starting).
FAILOVER_WAIT_S = 15.0


class _WorkerFailed(Exception):
    """A decode worker's stream broke: ``reason`` says how (a metric label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class _Accounting:
    """What this router has in flight per worker (beyond the last load report)."""

    prefill_tokens: Counter[str]
    requests: Counter[str]
    kv_blocks: Counter[str]


def _tie_key(block_hashes: list[int], token_ids: list[int], cache_key: str | None) -> int:
    """What ties between workers break by, the same on every router: the prompt_cache_key's hash where the client
    sent one (so under every policy its requests tie-break alike), else the prompt's first block's."""
    if cache_key is not None:
        return key_rank(cache_key, "")
    return block_hashes[0] if block_hashes else hash_block(ROOT_HASH, token_ids)


class Dispatcher:
    def __init__(self, directory: WorkerDirectory, index: PrefixIndex, client: WorkerClient,
                 policy: PolicyConfig, metrics: RouterMetrics, approx_ttl_s: float = 2.0, max_failovers: int = 2):
        self.directory = directory
        self.index = index
        self.client = client
        self.policy = policy
        self.max_failovers = max_failovers
        self.failover_wait_s = FAILOVER_WAIT_S
        self.metrics = metrics
        self.approx_ttl_s = approx_ttl_s
        self._round_robin = RoundRobin()
        self._inflight = _Accounting(Counter(), Counter(), Counter())

    # ---- the decision ----
    def _view(self, entry: WorkerEntry) -> WorkerView:
        w, load = entry.info.worker_id, entry.load
        used = max(load.kv_blocks_used, self._inflight.kv_blocks[w])
        return WorkerView(w, max(load.num_running, self._inflight.requests[w]), load.num_waiting,
                          max(load.waiting_prefill_tokens, self._inflight.prefill_tokens[w]),
                          load.kv_blocks_total - used, self.index.num_exact_blocks(w))

    def route(self, prompt_token_ids: list[int], block_hashes: list[int], block_size: int,
              local_prefill: bool = False, cache_key: str | None = None) -> Route:
        """``local_prefill``: the decode worker computes the prompt (prompt logprobs need its logits there).
        ``cache_key``: the client's prompt_cache_key (policy.py: where it counts)."""
        decoders = [self._view(e) for e in self.directory.live("decode")]
        prefillers = [self._view(e) for e in self.directory.live("prefill")]
        if not decoders:
            raise no_worker_error("decode")
        num_blocks = len(block_hashes)
        tie_key = _tie_key(block_hashes, prompt_token_ids, cache_key)
        needed = cdiv(len(prompt_token_ids), block_size)
        aware = self.policy.policy == "prefix_aware"
        overlaps = self.index.match(block_hashes) if aware else {}
        decode = self._decode_worker(decoders, needed, tie_key, overlaps, cache_key)
        decode_overlap = overlaps.get(decode, 0)
        if not prefillers or local_prefill or (aware and should_prefill_locally(
                len(prompt_token_ids), decode_overlap * block_size, self.policy)):
            return Route(decode, None, decode_overlap, needed, cache_key)
        if self.policy.policy == "round_robin":
            prefill = self._round_robin.choose(prefillers)
        elif self.policy.policy == "least_loaded":
            prefill = choose_least_loaded(prefillers, tie_key)
        else:
            prefill = choose_prefill_worker(prefillers, overlaps, num_blocks, block_size, self.policy, tie_key,
                                            cache_key)
        return Route(decode, prefill, overlaps.get(prefill, 0), needed, cache_key)

    def _decode_worker(self, decoders: list[WorkerView], needed: int, tie_key: int, overlaps: dict[str, int],
                       cache_key: str | None) -> str:
        """Under prefix_aware, the worker caching most of the prompt or first for the key, within the slack
        (policy.py); under the policies that ignore caches, the best ranked."""
        if self.policy.policy != "prefix_aware":
            return choose_decode_worker(decoders, needed, tie_key)
        return choose_decode_worker(decoders, needed, tie_key, overlaps, self.policy.decode_affinity_slack, cache_key)

    def plan(self, prompt_token_ids: list[int], cache_salt: str | None, block_size: int,
             local_prefill: bool = False, cache_key: str | None = None) -> Route:
        """Where one prompt goes, remembered in the index as approximate entries until the workers' events."""
        block_hashes = hash_prompt_blocks(prompt_token_ids, block_size, cache_salt)
        route = self.route(prompt_token_ids, block_hashes, block_size, local_prefill, cache_key)
        self._remember(route, block_hashes)
        return route

    @staticmethod
    def follow(route: Route, prompt_token_ids: list[int], block_size: int) -> Route:
        """Another sequence of an already prefilled prompt (``n`` > 1): on the same decode worker, prefilled
        there over the prompt's blocks its prefix cache now holds (only the last partial block is computed)."""
        return Route(route.decode_worker, None, len(prompt_token_ids) // block_size, route.kv_blocks_needed,
                     route.cache_key)

    # ---- one request ----
    async def generate(self, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str | None,
                       block_size: int, route: Route | None = None) -> AsyncGenerator[TokenChunk, None]:
        """Route (or take ``route`` from ``plan``/``follow``) and stream; the first chunk or an ``APIError``
        tells the caller where it stands.

        A remote prefill that fails before the first token (transfer error, prefill worker gone) is
        retried once as a local prefill on the same decode worker. A decode worker that dies, stops or
        fails mid-stream (or before the first token) has the request resumed on another decode worker
        after the tokens already sent, up to ``max_failovers`` times: the caller sees one stream. Then the
        failure is the stream's last item, as an error chunk or an ``APIError``.
        """
        if route is None:
            route = self.plan(prompt_token_ids, cache_salt, block_size)
        sent: list[int] = []  # output tokens the caller has had
        failed: set[str] = set()
        for failover in range(self.max_failovers + 1):
            last = failover == self.max_failovers
            try:
                async with contextlib.aclosing(self._attempts(route, prompt_token_ids, sampling, cache_salt,
                                                              block_size, sent)) as chunks:
                    async for chunk in chunks:
                        if chunk.error is not None and chunk.error_kind in _FAIL_OVER and not last:
                            raise _WorkerFailed(chunk.error_kind or "internal", chunk.error)
                        sent.extend(chunk.token_ids)
                        ended = chunk.finished or chunk.error is not None
                        yield chunk
                        if ended:  # read no further: a worker that dies after its last chunk ended nothing
                            return
                if last:
                    raise APIError(502, f"decode worker {route.decode_worker!r} ended the stream early", "internal")
                reason, message = "ended", "the stream ended early"
            except APIError as e:
                if e.code != "unreachable" or last:
                    raise
                reason, message = "unreachable", e.message
            except _WorkerFailed as e:
                reason, message = e.reason, str(e)
            failed.add(route.decode_worker)
            self.metrics.failovers.labels(reason=reason).inc()
            log.warning("decode worker %s failed a stream (%s: %s); resuming it after %d tokens elsewhere",
                        route.decode_worker, reason, message.splitlines()[0] if message else "", len(sent))
            route = await self._failover_route(prompt_token_ids + sent, cache_salt, block_size, failed, route.cache_key)

    async def _failover_route(self, token_ids: list[int], cache_salt: str | None, block_size: int,
                              failed: set[str], cache_key: str | None) -> Route:
        """A live decode worker other than ``failed`` (waiting up to ``failover_wait_s`` for one), to prefill
        the prompt and the tokens sent so far itself."""
        deadline = time.monotonic() + self.failover_wait_s
        while True:
            decoders = [self._view(e) for e in self.directory.live("decode") if e.info.worker_id not in failed]
            if decoders:
                break
            if time.monotonic() > deadline:
                raise no_worker_error("decode")
            await asyncio.sleep(0.2)
        block_hashes = hash_prompt_blocks(token_ids, block_size, cache_salt)
        needed = cdiv(len(token_ids), block_size)
        tie_key = _tie_key(block_hashes, token_ids, cache_key)
        overlaps = self.index.match(block_hashes)
        decode = self._decode_worker(decoders, needed, tie_key, overlaps, cache_key)
        return Route(decode, None, overlaps.get(decode, 0), needed, cache_key)

    async def _attempts(self, route: Route, prompt_token_ids: list[int], sampling: SamplingParams,
                        cache_salt: str | None, block_size: int, sent: list[int]) -> AsyncGenerator[TokenChunk, None]:
        """One decode worker's stream; a remote prefill that fails before the first token is tried once more
        as a local one."""
        if sent:  # resumed: prompt logprobs went out with the first chunk already
            sampling = replace(sampling, prompt_logprobs=None)
        for attempt in (route, replace(route, prefill_worker=None, prefill_overlap_blocks=0)):
            self.metrics.routed(attempt, block_size)
            started = False
            async with contextlib.aclosing(self._attempt(attempt, prompt_token_ids, sampling, cache_salt,
                                                         block_size, sent)) as chunks:
                async for chunk in chunks:
                    if not started and chunk.error_kind in _RETRY_LOCALLY and attempt.prefill_worker is not None:
                        self.metrics.retries.inc()
                        break  # retry locally
                    started = True
                    yield chunk
            if started:
                return

    async def _attempt(self, route: Route, prompt_token_ids: list[int], sampling: SamplingParams,
                       cache_salt: str | None, block_size: int, sent: list[int]) -> AsyncGenerator[TokenChunk, None]:
        """One call to the decode worker, counted in this router's in-flight figures while it lasts."""
        request = GenerateRequest(f"req-{uuid.uuid4().hex}", prompt_token_ids, sampling, cache_salt,
                                  route.prefill_worker, list(sent))
        prefiller = route.prefill_worker or route.decode_worker
        to_prefill = len(prompt_token_ids) + len(sent) - route.prefill_overlap_blocks * block_size
        needed = route.kv_blocks_needed
        inflight = self._inflight
        inflight.prefill_tokens[prefiller] += to_prefill
        inflight.requests[route.decode_worker] += 1
        inflight.kv_blocks[route.decode_worker] += needed
        prefill_pending = True
        try:
            # aclosing: leaving early (client gone) must close the worker stream now, not at GC.
            async with contextlib.aclosing(self.client.generate(route.decode_worker, request)) as stream:
                async for chunk in stream:
                    if prefill_pending:
                        inflight.prefill_tokens[prefiller] -= to_prefill
                        prefill_pending = False
                    yield chunk
        except WorkerUnreachable as e:
            raise APIError(503, f"worker unreachable: {e}; try again", "unreachable",
                           retry_after_s=1) from e
        finally:
            if prefill_pending:
                inflight.prefill_tokens[prefiller] -= to_prefill
            inflight.requests[route.decode_worker] -= 1
            inflight.kv_blocks[route.decode_worker] -= needed
            for counter in (inflight.prefill_tokens, inflight.requests, inflight.kv_blocks):
                counter += Counter()  # drops the zero entries

    def _remember(self, route: Route, block_hashes: list[int]) -> None:
        """Approximate index entries: where this prompt's blocks will be cached once it runs."""
        expires_at = time.monotonic() + self.approx_ttl_s
        if route.prefill_worker is not None:
            self.index.insert_approximate(route.prefill_worker, block_hashes, expires_at)
        self.index.insert_approximate(route.decode_worker, block_hashes, expires_at)
