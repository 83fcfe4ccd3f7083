"""The one block-hash function, shared by workers (prefix cache) and routers (prefix index).

A block's hash chains its parent's hash, so equal hashes mean equal *prefixes*, not just equal
blocks. The salt (tenant / ``cache_salt``) enters the first block, which isolates whole chains.
Hashes are 63-bit ints so they fit msgpack, Redis and JSON without fuss; a hit is still re-checked
against the block's tokens by the pool, so a collision can never serve wrong KV.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent of the first block of every chain.
ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int], salt: str | None = None) -> int:
    """Hash one full block of ``token_ids`` chained onto ``parent_hash``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", parent_hash))
    if salt:
        h.update(b"salt:" + salt.encode("utf-8") + b"\0")
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(h.digest(), "little") & 0x7FFF_FFFF_FFFF_FFFF


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
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        # Only the first block of a chain carries the salt; its hash then salts every child.
        parent = hash_block(parent, token_ids[start : start + block_size], salt if start == 0 else None)
        hashes.append(parent)
    return hashes
