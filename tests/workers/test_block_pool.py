"""Block pool and KV cache manager under thousands of random operations.

Besides ``check_integrity()``, a fake KV cache records which token wrote each slot, so any block
shared or reused wrongly shows up as a request whose table reads back the wrong tokens.
"""

from __future__ import annotations

import random

import pytest

from workers.engine.block_pool import BlockPool
from workers.engine.kv_cache_manager import KVCacheManager
from workers.engine.request import Request
from workers.protocol.kv_events import BlockRemoved, BlockStored
from workers.protocol.sampling_params import SamplingParams

BS = 4


class FakeKV:
    """slot -> token written there, standing in for real K/V tensors."""

    def __init__(self, num_blocks: int):
        self.slots: list[int | None] = [None] * (num_blocks * BS)

    def write(self, mgr: KVCacheManager, req: Request, start: int, end: int) -> None:
        table = mgr.block_ids(req.request_id)
        for p in range(start, end):
            self.slots[table[p // BS] * BS + p % BS] = req.token_ids[p]

    def check(self, mgr: KVCacheManager, req: Request) -> None:
        table = mgr.block_ids(req.request_id)
        got = [self.slots[table[p // BS] * BS + p % BS] for p in range(req.num_computed_tokens)]
        assert got == req.token_ids[: req.num_computed_tokens], req.request_id


def test_pool_basic_allocate_free_evict_events():
    pool = BlockPool(4, BS)
    blocks = pool.allocate(3)
    assert blocks is not None and pool.num_free_blocks == 1
    assert pool.allocate(2) is None
    pool.cache_blocks(blocks[:2], [11, 12], [[1, 2, 3, 4], [5, 6, 7, 8]], parent_hash=None)
    pool.free(reversed(blocks))
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 2
    assert pool.get_cached_block(11, [1, 2, 3, 4]) is blocks[0]
    assert pool.get_cached_block(11, [1, 2, 3, 5]) is None  # token re-check on a hit
    pool.allocate(4)  # evicts both cached blocks
    events = pool.take_events()
    assert events == [BlockStored((11, 12), None), BlockRemoved((12, 11))]
    assert pool.num_cached_blocks == 0 and pool.check_integrity()


def test_uncached_blocks_go_first_lowest_ids_first_and_in_ascending_order():
    """Free blocks without a hash are handed out before any cache is evicted, lowest ids first, so a batch's blocks
    stay packed (decode attention reads neighbouring blocks faster); evicted cache keeps its LRU order; an
    allocation's blocks come back in ascending order whatever order they were freed in."""
    pool = BlockPool(8, BS)
    a = pool.allocate(3)  # blocks 0, 1, 2
    b = pool.allocate(3)  # blocks 3, 4, 5
    assert a is not None and b is not None
    assert [x.block_id for x in a + b] == [0, 1, 2, 3, 4, 5]
    pool.cache_blocks(b[:2], [31, 32], [[1] * BS, [2] * BS], parent_hash=None)
    pool.free(reversed(b))  # 5 (no hash) then 4, 3 (cached)
    pool.free(reversed(a))  # 2, 1, 0: no hash
    got = pool.allocate(4)
    assert got is not None and [x.block_id for x in got] == [0, 1, 2, 5]  # uncached, lowest first; 6, 7 remain
    assert pool.take_events() == [BlockStored((31, 32), None)] and pool.num_cached_blocks == 2  # nothing evicted
    got = pool.allocate(3)  # 6, 7, then the oldest cache: block 4 (freed before 3)
    assert got is not None and [x.block_id for x in got] == [4, 6, 7]
    assert pool.take_events() == [BlockRemoved((32,))] and pool.check_integrity()
    assert not pool.reset_prefix_cache()  # blocks are in use
    pool.free(got)
    pool.free(pool.blocks[i] for i in (0, 1, 2, 5))
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0 and pool.check_integrity()
    again = pool.allocate(8)
    assert again is not None and [x.block_id for x in again] == list(range(8))


@pytest.mark.parametrize("seed", range(4))
def test_random_operations_keep_integrity(seed):
    rng = random.Random(seed)
    num_blocks = 48
    pool = BlockPool(num_blocks, BS)
    mgr = KVCacheManager(pool)
    kv = FakeKV(num_blocks)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(5)]
    live: dict[str, Request] = {}
    stats = {"hits": 0, "preempt": 0, "evict": 0, "fail": 0}
    next_id = 0

    def admit(req: Request) -> bool:
        blocks, n = mgr.get_computed_blocks(req)
        req.num_computed_tokens = n
        if not mgr.allocate_slots(req, req.num_tokens - n, blocks):
            req.num_computed_tokens = 0
            return False
        stats["hits"] += n > 0
        kv.write(mgr, req, n, req.num_tokens)
        req.num_computed_tokens = req.num_tokens
        mgr.cache_full_blocks(req)
        return True

    for _ in range(3000):
        op = rng.random()
        if op < 0.35 or not live:  # new request, often sharing a prefix
            tokens = list(rng.choice(prefixes)) if rng.random() < 0.7 else []
            tokens += [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
            req = Request(f"r{next_id}", tokens, SamplingParams(), cache_salt=rng.choice([None, "t1"]))
            next_id += 1
            if admit(req):
                live[req.request_id] = req
            else:
                stats["fail"] += 1
        elif op < 0.75:  # decode: grow by one token
            req = rng.choice(list(live.values()))
            req.append_output_token(rng.randrange(50), None)
            if mgr.allocate_slots(req, 1):
                kv.write(mgr, req, req.num_computed_tokens, req.num_tokens)
                req.num_computed_tokens += 1
                mgr.cache_full_blocks(req)
            else:  # preempt: free everything, recompute later (from the cache if it survives)
                mgr.free(req)
                req.num_computed_tokens = 0
                stats["preempt"] += 1
                if not admit(req):
                    del live[req.request_id]
        elif op < 0.95:  # finish
            mgr.free(live.pop(rng.choice(list(live))))
        else:  # share: a copy of a live request's tokens hits its cached blocks
            src = rng.choice(list(live.values()))
            req = Request(f"r{next_id}", list(src.token_ids), SamplingParams(), cache_salt=src.cache_salt)
            next_id += 1
            if admit(req):
                live[req.request_id] = req
        stats["evict"] += sum(isinstance(e, BlockRemoved) for e in pool.take_events())
        assert pool.check_integrity()
        for req in live.values():
            kv.check(mgr, req)
    for req in list(live.values()):
        mgr.free(req)
    assert pool.num_used_blocks == 0 and mgr.num_requests == 0
    assert pool.check_integrity()
    # the random walk really exercised sharing, preemption and eviction
    assert stats["hits"] > 50 and stats["preempt"] > 5 and stats["evict"] > 20, stats


def test_salt_isolates_prefixes():
    pool = BlockPool(16, BS)
    mgr = KVCacheManager(pool)
    a = Request("a", list(range(12)), SamplingParams(), cache_salt="tenant-a")
    mgr.allocate_slots(a, 12)
    a.num_computed_tokens = 12
    mgr.cache_full_blocks(a)
    same = Request("b", list(range(12)), SamplingParams(), cache_salt="tenant-a")
    other = Request("c", list(range(12)), SamplingParams(), cache_salt="tenant-b")
    assert mgr.get_computed_blocks(same)[1] == 8  # 2 full blocks (the last token is recomputed)
    assert mgr.get_computed_blocks(other)[1] == 0
