"""The router's view of every worker's prefix cache: a radix tree of chained block hashes.

Each node is one KV block (its chained hash) and is tagged with the workers that hold it. Because a
block's hash chains its parent's, a path from the root spells one prefix, and ``match`` walks the
prompt's hashes down the tree, counting for each worker how many *leading* blocks it holds:

    root ─ h(A) {p0,p1} ─ h(AB) {p0,p1} ─ h(ABC) {p0}        match([h(A), h(AB), h(ABD)])
                                       └ h(ABD) {p1}         -> {p0: 2, p1: 3}

Tags are exact (from a worker's ``BlockStored`` events) or approximate: the router's own routing
decision, inserted at once and expiring after a TTL, so a burst of requests sharing a prefix goes
to one worker before that worker's events arrive. An exact event always overwrites an approximate
tag; ``BlockRemoved`` drops either.

A stored block whose parent the index has never seen (events of a restarted router, a trimmed
stream) hangs under an empty placeholder for that parent, kept at the root until the parent's own
event says where it belongs. Nodes with no tags and no children are pruned.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

EXACT = math.inf  # the expiry of an exact tag


@dataclass(eq=False, slots=True)
class _Node:
    block_hash: int | None
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    # worker id -> expiry time (EXACT for a tag from the worker's own events)
    workers: dict[str, float] = field(default_factory=dict)
    # The keys of ``workers`` as a set, for fast subset tests in ``match``.
    tagged: set[str] = field(default_factory=set)


class PrefixIndex:
    def __init__(self) -> None:
        self.root = _Node(None, None)
        self._nodes: dict[int, _Node] = {}
        self._worker_blocks: dict[str, set[int]] = {}
        self._num_exact: dict[str, int] = {}
        # (expiry, worker, hash) of approximate tags, earliest first; stale entries are skipped.
        self._expiries: list[tuple[float, str, int]] = []

    # ---- queries ----
    def match(self, block_hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each worker holds (workers holding none are absent)."""
        # The hot path of routing: one dict lookup and one C-level subset test per block.
        if not block_hashes:
            return {}
        node = self.root.children.get(block_hashes[0])
        if node is None or not node.tagged:
            return {}
        active = set(node.tagged)
        overlaps: dict[str, int] = {}
        depth = 1
        for block_hash in block_hashes[1:]:
            node = node.children.get(block_hash)
            if node is None:
                break
            tagged = node.tagged
            if not active <= tagged:
                for worker in active - tagged:
                    overlaps[worker] = depth
                active &= tagged
                if not active:
                    break
            depth += 1
        for worker in active:
            overlaps[worker] = depth
        return overlaps

    def num_exact_blocks(self, worker: str) -> int:
        """Blocks the worker's own events say it caches (the same on every router that follows them)."""
        return self._num_exact.get(worker, 0)

    def blocks_of(self, worker: str) -> set[int]:
        """Hashes tagged with ``worker`` (exact or not yet expired)."""
        return set(self._worker_blocks.get(worker, ()))

    @property
    def num_nodes(self) -> int:
        return len(self._nodes)

    # ---- exact updates (a worker's events) ----
    def apply_stored(self, worker: str, block_hashes: Sequence[int], parent_hash: int | None) -> None:
        """``BlockStored``: the worker now holds this chain, which continues ``parent_hash``."""
        parent = self.root if parent_hash is None else self._node(parent_hash, placeholder_parent=self.root)
        for block_hash in block_hashes:
            node = self._node(block_hash, placeholder_parent=parent)
            if node.parent is not parent:  # a placeholder finds its real parent
                self._relink(node, parent)
            self._tag(node, worker, EXACT)
            parent = node

    def apply_removed(self, worker: str, block_hashes: Iterable[int]) -> None:
        """``BlockRemoved``: the worker evicted these blocks."""
        for block_hash in block_hashes:
            node = self._nodes.get(block_hash)
            expiry = node.workers.pop(worker, None) if node is not None else None
            if node is not None and expiry is not None:
                node.tagged.discard(worker)
                if expiry == EXACT:
                    self._num_exact[worker] -= 1
                self._worker_blocks[worker].discard(block_hash)
                self._prune(node)

    def clear_worker(self, worker: str) -> None:
        """``AllBlocksCleared``, or the worker left: drop all its tags."""
        self.apply_removed(worker, list(self._worker_blocks.get(worker, ())))
        self._worker_blocks.pop(worker, None)
        self._num_exact.pop(worker, None)

    # ---- approximate updates (the router's own decisions) ----
    def insert_approximate(self, worker: str, block_hashes: Sequence[int], expires_at: float) -> None:
        """Assume ``worker`` will hold this prompt's chain until ``expires_at`` unless events say otherwise."""
        parent = self.root
        for block_hash in block_hashes:
            node = self._node(block_hash, placeholder_parent=parent)
            if node.parent is not parent:
                self._relink(node, parent)
            if node.workers.get(worker, -math.inf) < expires_at:
                self._tag(node, worker, expires_at)
                heapq.heappush(self._expiries, (expires_at, worker, block_hash))
            parent = node

    def expire(self, now: float) -> int:
        """Drop approximate tags whose time is up; returns how many."""
        dropped = 0
        while self._expiries and self._expiries[0][0] <= now:
            expires_at, worker, block_hash = heapq.heappop(self._expiries)
            node = self._nodes.get(block_hash)
            if node is not None and node.workers.get(worker) == expires_at:
                self.apply_removed(worker, (block_hash,))
                dropped += 1
        return dropped

    # ---- internals ----
    def _node(self, block_hash: int, placeholder_parent: _Node) -> _Node:
        node = self._nodes.get(block_hash)
        if node is None:
            node = _Node(block_hash, placeholder_parent)
            placeholder_parent.children[block_hash] = node
            self._nodes[block_hash] = node
        return node

    def _relink(self, node: _Node, parent: _Node) -> None:
        old = node.parent
        assert old is not None and node.block_hash is not None
        del old.children[node.block_hash]
        node.parent = parent
        parent.children[node.block_hash] = node
        self._prune(old)

    def _tag(self, node: _Node, worker: str, expires_at: float) -> None:
        assert node.block_hash is not None
        if expires_at == EXACT and node.workers.get(worker) != EXACT:
            self._num_exact[worker] = self._num_exact.get(worker, 0) + 1
        node.workers[worker] = expires_at
        node.tagged.add(worker)
        self._worker_blocks.setdefault(worker, set()).add(node.block_hash)

    def _prune(self, node: _Node | None) -> None:
        while node is not None and node is not self.root and not node.workers and not node.children:
            assert node.block_hash is not None and node.parent is not None
            del node.parent.children[node.block_hash]
            del self._nodes[node.block_hash]
            node = node.parent

    def check_integrity(self) -> bool:
        """Every invariant the index relies on; tests call it after random operations."""
        seen: dict[int, _Node] = {}
        stack = [self.root]
        while stack:
            node = stack.pop()
            for block_hash, child in node.children.items():
                assert child.block_hash == block_hash and child.parent is node
                assert block_hash not in seen, "a node reachable twice"
                assert child.workers or child.children, "an empty leaf was not pruned"
                seen[block_hash] = child
                stack.append(child)
        assert seen.keys() == self._nodes.keys()
        for worker, hashes in self._worker_blocks.items():
            for block_hash in hashes:
                assert worker in self._nodes[block_hash].workers
            exact = sum(self._nodes[h].workers[worker] == EXACT for h in hashes)
            assert self._num_exact.get(worker, 0) == exact, (worker, exact)
        for node in seen.values():
            assert node.tagged == node.workers.keys()
            for worker in node.workers:
                assert node.block_hash in self._worker_blocks[worker]
        return True
