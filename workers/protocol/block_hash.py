"""The one block-hash function, shared by workers (prefix cache) and routers (prefix index).

A block's hash chains its parent's hash, so equal hashes mean equal *prefixes*, not just equal
blocks. The salt (tenant / ``cache_salt``) enters the first block, which isolates whole chains.
Hashes are 63-bit ints so they fit msgpack, Redis and JSON without fuss; a hit is still re-checked
against the block's tokens by the pool, so a collision can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

# Parent of the first block of every chain.
ROOT_HASH = 0

_U32 = "I"
assert array(_U32).itemsize == 4, "token ids are hashed as 4-byte unsigned ints"


def _token_bytes(token_ids: Sequence[int]) -> memoryview:
    """Token ids as little-endian uint32 bytes (the same on every machine of a cluster)."""
    ids = array(_U32, token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    return memoryview(ids).cast("B")


def _chain(parent_hash: int, block: memoryview, salt: str | None) -> int:
    h = hashlib.blake2b(parent_hash.to_bytes(8, "little", signed=True), digest_size=8)
    if salt:
        h.update(b"salt:" + salt.encode("utf-8") + b"\0")
    h.update(block)
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Hash one full block of ``token_ids`` chained onto ``parent_hash``."""
    return _chain(parent_hash, _token_bytes(token_ids), salt)


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: str | None = None,
    parent_hashes: Sequence[int] = (),
) -> list[int]:
    """Chained hashes of every *full* block of ``token_ids``.

    ``parent_hashes`` are hashes already computed for the leading blocks (extended incrementally
    as a request grows); they are returned as the prefix of the result.
    """
    hashes = list(parent_hashes)
    parent = hashes[-1] if hashes else ROOT_HASH
    first = len(hashes) * block_size
    num_full = len(token_ids) // block_size * block_size
    if num_full <= first:
        return hashes
    # One conversion of the new tokens, then a slice per block: ~1.5x faster than packing each block.
    data, step = _token_bytes(token_ids[first:num_full]), block_size * 4
    for offset in range(0, len(data), step):
        # Only the first block of a chain carries the salt; its hash then salts every child.
        parent = _chain(parent, data[offset : offset + step], salt if first + offset == 0 else None)
        hashes.append(parent)
    return hashes
