"""KV-cache events that workers publish and routers consume to keep their prefix index.

Past-tense nouns: each says what already happened to the worker's cache.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became reusable prefix cache, in chain order (``parent_hash`` of the first)."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted: their prefix is no longer cached on this worker."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was dropped (reset or restart)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
