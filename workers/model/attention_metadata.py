"""What one forward pass needs to find and store KV in the paged cache.

Rows of the batch are ordered decodes first (one token each), then prefill chunks:

    rows:  d0 d1 d2 | p0 p0 p0 p0 p1 p1
           decode   | prefill, query_start_loc = [0, 4, 6]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot of each row's K/V (block_id * block_size + offset)
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [Bd, M]
    decode_seq_lens: torch.Tensor  # [Bd] tokens in cache, the new one included
    prefill_block_tables: torch.Tensor  # [Bp, M]
    prefill_query_start_loc: torch.Tensor  # [Bp + 1], relative to the first prefill row
    prefill_seq_lens: torch.Tensor  # [Bp]
    backend: str | None = None
    # Longest prefill chunk, known on the host: the Triton kernel sizes its grid without a GPU sync.
    prefill_max_query_len: int | None = None
