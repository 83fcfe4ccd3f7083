"""Paged KV block pool: ref counts, an LRU free list, and the prefix cache (hash -> block).

Ownership: a block with ``ref_cnt > 0`` belongs to the requests that hold it and is never reused.
A block with ``ref_cnt == 0`` sits in the free list; if it still carries a hash it is *evictable
prefix cache*: a later request may revive it (``touch``) until ``allocate`` hands it out again, at
which point its hash is dropped and a ``BlockRemoved`` event is queued.

Free blocks without a hash (never cached, or a partial last block) are handed out first, lowest id first: no
cache is evicted while one is left, and a batch's blocks stay packed in ascending runs, which decode attention on
CPU reads ~10% faster at batch 8 and 450-token contexts than the scattered order a recycled free list gives (the
hardware prefetcher runs across neighbouring blocks). Cached free blocks are evicted least-recently-freed first;
requests free their blocks tail-first, so a prefix's last blocks go before its first ones (a shorter prefix stays
useful longer). An allocation's blocks come back in ascending id order either way.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from workers.protocol.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(slots=True)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache.
    block_hash: int | None = None
    # The tokens the block holds, re-checked on a cache hit (a hash collision never serves wrong KV).
    token_ids: tuple[int, ...] | None = None
    # Hash of the block before it in its chain (None: the chain's first block); for snapshots.
    parent_hash: int | None = None


class BlockPool:
    """Fixed set of ``num_blocks`` KV blocks of ``block_size`` tokens each."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._clean: list[int] = list(range(num_blocks))  # free, no hash: a min-heap of ids
        self._evictable: OrderedDict[int, None] = OrderedDict()  # free and cached, least recently freed first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._events: list[KVEvent] = []

    # ---- queries (pure) ----
    @property
    def num_free_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now (free or evictable cache)."""
        return len(self._clean) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def get_cached_block(self, block_hash: int, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for this hash, if its tokens really match."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != tuple(token_ids):
            return None
        return block

    # ---- mutations ----
    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Take ``num_blocks`` blocks (ref 1 each, ascending ids): uncached ones first, then the oldest cache
        evicted; ``None`` if short."""
        if num_blocks > self.num_free_blocks:
            return None
        clean = min(num_blocks, len(self._clean))
        ids = [heapq.heappop(self._clean) for _ in range(clean)]
        evicted: list[int] = []
        for _ in range(num_blocks - clean):
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.block_hash is not None
            evicted.append(block.block_hash)
            self._uncache(block)
            ids.append(block_id)
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        out = [self.blocks[i] for i in sorted(ids)]
        for block in out:
            block.ref_cnt = 1
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on blocks found in the prefix cache."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._evictable[block.block_id]  # a cache hit: it carries a hash
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; blocks reaching zero are free: cached ones join the eviction order in the
        given order, the others the uncached heap."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    heapq.heappush(self._clean, block.block_id)
                else:
                    self._evictable[block.block_id] = None

    def cache_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        parent_hash: int | None,
    ) -> None:
        """Register full, computed blocks as prefix cache (a chain starting after ``parent_hash``).

        A hash already cached by another block (two requests computed the same prefix at once)
        keeps the first block; the duplicate stays private to its request and is freed normally.
        """
        if not self.enable_prefix_caching:
            return
        stored: list[int] = []
        stored_parent = parent_hash
        parent = parent_hash
        for block, block_hash, tokens in zip(blocks, block_hashes, token_ids, strict=True):
            if block.block_hash is not None or block_hash in self._cached:
                # Skipped: an event stays one unbroken chain, so flush what came before.
                if stored:
                    self._events.append(BlockStored(tuple(stored), stored_parent))
                    stored = []
                parent = stored_parent = block_hash
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(tokens)
            block.parent_hash = parent
            self._cached[block_hash] = block.block_id
            stored.append(block_hash)
            parent = block_hash
        if stored:
            self._events.append(BlockStored(tuple(stored), stored_parent))

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; only possible while no request holds a block."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._uncache(block)
        self._clean = list(range(self.num_blocks))  # every block is free and uncached now
        self._evictable.clear()
        self._events.append(AllBlocksCleared())
        return True

    def cached_chains(self) -> list[tuple[int, int | None]]:
        """Every cached block as (hash, parent hash): the state a snapshot of this pool's events gives."""
        return [(h, self.blocks[b].parent_hash) for h, b in self._cached.items()]

    def take_events(self) -> list[KVEvent]:
        """Drain the queued events (once per engine step, published as a batch)."""
        events, self._events = self._events, []
        return events

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.parent_hash = None

    def check_integrity(self) -> bool:
        """Every invariant the pool relies on; tests call it after each random operation."""
        clean, evictable = set(self._clean), set(self._evictable)
        assert len(clean) == len(self._clean) and not clean & evictable
        free_ids = clean | evictable
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), block
            if block.block_id in free_ids:
                assert (block.block_hash is None) == (block.block_id in clean), block
            if block.block_hash is not None:
                assert self._cached.get(block.block_hash) == block.block_id, block
                assert block.token_ids is not None and len(block.token_ids) == self.block_size
        for block_hash, block_id in self._cached.items():
            assert self.blocks[block_id].block_hash == block_hash
        return True
