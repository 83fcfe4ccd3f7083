"""The radix index against a brute-force reference (a set of (worker, hash) tags per worker)."""

from __future__ import annotations

import math
import random

import pytest

from router.prefix_index import PrefixIndex
from workers.protocol.block_hash import hash_prompt_blocks

BS = 4


class BruteForceIndex:
    def __init__(self) -> None:
        self.tags: dict[tuple[str, int], float] = {}

    def stored(self, worker: str, hashes: list[int]) -> None:
        for h in hashes:
            self.tags[(worker, h)] = math.inf

    def approximate(self, worker: str, hashes: list[int], expires_at: float) -> None:
        for h in hashes:
            self.tags[(worker, h)] = max(self.tags.get((worker, h), -math.inf), expires_at)

    def removed(self, worker: str, hashes: list[int]) -> None:
        for h in hashes:
            self.tags.pop((worker, h), None)

    def clear(self, worker: str) -> None:
        self.tags = {k: v for k, v in self.tags.items() if k[0] != worker}

    def expire(self, now: float) -> None:
        self.tags = {k: v for k, v in self.tags.items() if v > now}

    def match(self, hashes: list[int], workers: list[str]) -> dict[str, int]:
        out = {}
        for w in workers:
            n = 0
            while n < len(hashes) and (w, hashes[n]) in self.tags:
                n += 1
            if n:
                out[w] = n
        return out


def make_chains(rng: random.Random, num_chains: int) -> list[list[int]]:
    """Prompts that share prefixes with each other (a branching family of token sequences)."""
    prompts: list[list[int]] = []
    for _ in range(num_chains):
        if prompts and rng.random() < 0.7:
            base = rng.choice(prompts)
            cut = rng.randrange(0, len(base) + 1)
            tokens = base[:cut] + [rng.randrange(50) for _ in range(rng.randrange(1, 6) * BS)]
        else:
            tokens = [rng.randrange(50) for _ in range(rng.randrange(1, 10) * BS)]
        prompts.append(tokens)
    return [hash_prompt_blocks(p, BS, rng.choice([None, None, "tenant"])) for p in prompts]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_agree_with_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(rng.choice([2, 5, 16]))]
    chains = make_chains(rng, 40)
    index, ref = PrefixIndex(), BruteForceIndex()
    now = 0.0
    for step in range(3000):
        op = rng.random()
        worker = rng.choice(workers)
        chain = rng.choice(chains)
        if not chain:
            continue
        if op < 0.35:  # a worker stores a run of its chain (its parent may be unknown to the index)
            a = rng.randrange(len(chain))
            b = rng.randrange(a, len(chain)) + 1
            index.apply_stored(worker, chain[a:b], chain[a - 1] if a else None)
            ref.stored(worker, chain[a:b])
        elif op < 0.6:  # evictions, tail first or scattered
            hashes = rng.sample(chain, rng.randrange(1, len(chain) + 1))
            index.apply_removed(worker, hashes)
            ref.removed(worker, hashes)
        elif op < 0.7:
            expires_at = now + rng.uniform(0.5, 5.0)
            hashes = chain[: rng.randrange(1, len(chain) + 1)]
            index.insert_approximate(worker, hashes, expires_at)
            ref.approximate(worker, hashes, expires_at)
        elif op < 0.72:
            index.clear_worker(worker)
            ref.clear(worker)
        elif op < 0.8:
            now += rng.uniform(0.0, 1.0)
            index.expire(now)
            ref.expire(now)
        else:
            query = chain[: rng.randrange(1, len(chain) + 1)]
            assert index.match(query) == ref.match(query, workers), f"step {step}"
        if step % 50 == 0:
            assert index.check_integrity()
    for chain in chains:
        assert index.match(chain) == ref.match(chain, workers)
    for w in workers:
        index.clear_worker(w)
    assert index.num_nodes == 0 and index.check_integrity()


def test_match_counts_leading_blocks_per_worker() -> None:
    a = hash_prompt_blocks(list(range(12)), BS)
    b = hash_prompt_blocks(list(range(8)) + [99, 98, 97, 96], BS)
    index = PrefixIndex()
    index.apply_stored("p0", a, None)
    index.apply_stored("p1", b, None)
    assert index.match(a) == {"p0": 3, "p1": 2}
    assert index.match(b) == {"p0": 2, "p1": 3}
    index.apply_removed("p0", a[1:2])  # a hole: only the leading run counts
    assert index.match(a) == {"p0": 1, "p1": 2}


def test_exact_event_overwrites_approximate_tag() -> None:
    chain = hash_prompt_blocks(list(range(8)), BS)
    index = PrefixIndex()
    index.insert_approximate("p0", chain, expires_at=1.0)
    assert index.match(chain) == {"p0": 2}
    index.apply_stored("p0", chain[:1], None)
    index.expire(2.0)
    assert index.match(chain) == {"p0": 1}  # the exact block stays, the guess expired


def test_salted_chains_never_match_each_other() -> None:
    tokens = list(range(16))
    index = PrefixIndex()
    index.apply_stored("p0", hash_prompt_blocks(tokens, BS, "tenant-a"), None)
    assert index.match(hash_prompt_blocks(tokens, BS, "tenant-b")) == {}
    assert index.match(hash_prompt_blocks(tokens, BS, "tenant-a")) == {"p0": 4}
