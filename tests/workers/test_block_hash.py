"""The block hash is a cluster-wide format (routers and workers of a cluster must agree): it is
checked against its definition written out plainly, for every length, salt and resume point."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from workers.protocol.block_hash import hash_block, hash_prompt_blocks


def reference_chain(token_ids: list[int], block_size: int, salt: str | None) -> list[int]:
    """blake2b-64 over (parent as int64 LE, salt once at the chain's root, tokens as uint32 LE), top bit cleared."""
    hashes, parent = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(digest_size=8)
        h.update(struct.pack("<q", parent))
        if salt and start == 0:
            h.update(b"salt:" + salt.encode() + b"\0")
        h.update(struct.pack(f"<{block_size}I", *token_ids[start : start + block_size]))
        parent = int.from_bytes(h.digest(), "little") & (2**63 - 1)
        hashes.append(parent)
    return hashes


@pytest.mark.parametrize("salt", [None, "tenant-a"])
@pytest.mark.parametrize("length", [0, 1, 15, 16, 17, 48, 1000])
def test_hashes_follow_the_definition_and_resume(length: int, salt: str | None) -> None:
    rng = random.Random(length)
    tokens = [rng.randrange(2**32) for _ in range(length)]
    expected = reference_chain(tokens, 16, salt)
    assert hash_prompt_blocks(tokens, 16, salt) == expected
    for known in range(len(expected) + 1):  # extended from any number of blocks already hashed
        assert hash_prompt_blocks(tokens, 16, salt, expected[:known]) == expected
    if expected:
        assert hash_block(0, tokens[:16], salt) == expected[0]
        assert all(h < 2**63 for h in expected)


def test_token_ids_out_of_uint32_range_are_refused() -> None:
    with pytest.raises(OverflowError):
        hash_prompt_blocks([-1] * 16, 16)
