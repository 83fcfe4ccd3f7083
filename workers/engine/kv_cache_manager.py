"""Per-request block tables on top of the ``BlockPool``, with prefix-cache lookups.

The scheduler asks three things: how much of a prompt is already cached
(``get_computed_blocks``), whether a request can have room for its next tokens
(``allocate_slots``, ``None``-free: it returns ``False`` and the scheduler preempts), and to let
go (``free``). After each step ``cache_full_blocks`` registers newly completed blocks.

Block table of a request with block_size 4 and 10 tokens, 2 of its blocks from the cache:

    tokens:  t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 .. ..
    blocks:  [cached b7] | [cached b2] | [new   b5]
"""

from __future__ import annotations

from collections.abc import Sequence

from kernels.host_math import cdiv
from workers.engine.block_pool import BlockPool, KVBlock
from workers.engine.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._req_blocks: dict[str, list[KVBlock]] = {}
        self._req_block_ids: dict[str, list[int]] = {}  # the same tables as ids: a step copies each one
        # Leading blocks of each request already registered in the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request's tokens: (blocks, number of tokens).

        At least one token is always left to compute, so the step can produce logits.
        """
        if not self.pool.enable_prefix_caching or request.needs_prompt_logits:
            return [], 0
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.block_hashes(bs)
        blocks: list[KVBlock] = []
        for i in range(max_blocks):
            block = self.pool.get_cached_block(hashes[i], request.token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * bs

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        held = len(self._req_blocks.get(request.request_id, ()))
        total_tokens = request.num_computed_tokens + num_new_tokens
        return max(0, cdiv(total_tokens, self.block_size) - held - num_new_computed_blocks)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        keep_free: int = 0,
    ) -> bool:
        """Reserve room for ``num_new_tokens`` after the computed ones; ``False`` if the pool is short
        (or would keep fewer than ``keep_free`` blocks free afterwards).

        ``new_computed_blocks`` are prefix-cache hits (from ``get_computed_blocks``) joining the
        request's table now; ``request.num_computed_tokens`` must already count them.
        """
        if not new_computed_blocks and not keep_free:  # a running request's next tokens, every step
            held = self._req_block_ids.get(request.request_id)
            if held is not None and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
                return True  # room in the last block: 15 decode steps of 16, answered in one lookup
        num_needed = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        if not num_needed and not new_computed_blocks and keep_free <= self.pool.num_free_blocks:
            return True
        # Reviving an evictable cached block takes it out of the free list too.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed + num_revived + keep_free > self.pool.num_free_blocks:
            return False
        blocks = self._req_blocks.setdefault(request.request_id, [])
        ids = self._req_block_ids.setdefault(request.request_id, [])
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            ids.extend(b.block_id for b in new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        if num_needed:
            new_blocks = self.pool.allocate(num_needed)
            assert new_blocks is not None
            blocks.extend(new_blocks)
            ids.extend(b.block_id for b in new_blocks)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly computed full blocks as prefix cache."""
        bs = self.block_size
        first = self._num_cached_blocks.get(request.request_id, 0)
        if request.num_computed_tokens // bs <= first:
            return  # no block filled since the last call: 15 decode steps of 16
        blocks = self._req_blocks.get(request.request_id)
        if not blocks:
            return
        last = min(request.num_computed_tokens // bs, len(blocks))
        if last <= first:
            return
        hashes = request.block_hashes(bs)
        self.pool.cache_blocks(
            blocks[first:last],
            hashes[first:last],
            [request.token_ids[i * bs : (i + 1) * bs] for i in range(first, last)],
            parent_hash=hashes[first - 1] if first else None,
        )
        self._num_cached_blocks[request.request_id] = last

    def free(self, request: Request) -> None:
        """Release every block of the request, tail first (see ``BlockPool``)."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._req_block_ids.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        """A copy of the request's block table (the caller may keep it past later allocations)."""
        return list(self._req_block_ids.get(request_id, ()))

    @property
    def num_requests(self) -> int:
        return len(self._req_blocks)
