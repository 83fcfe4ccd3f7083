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


def encode_events(events: list[KVEvent]) -> list[list[object]]:
    """Plain lists for msgpack: ["stored", hashes, parent] / ["removed", hashes] / ["cleared"]."""
    out: list[list[object]] = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(["stored", list(e.block_hashes), e.parent_hash])
        elif isinstance(e, BlockRemoved):
            out.append(["removed", list(e.block_hashes)])
        else:
            out.append(["cleared"])
    return out


def decode_events(items: list[list[object]]) -> list[KVEvent]:
    events: list[KVEvent] = []
    for item in items:
        kind = item[0]
        if kind == "stored":
            events.append(BlockStored(tuple(item[1]), item[2]))  # type: ignore[arg-type]
        elif kind == "removed":
            events.append(BlockRemoved(tuple(item[1])))  # type: ignore[arg-type]
        elif kind == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
    return events
