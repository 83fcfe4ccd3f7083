"""Timing profiles built from formulas, for tests that need known step times (no measuring)."""

from __future__ import annotations

from workers.protocol.timing_profile import Curve, Grid, TimingProfile


def linear_profile(*, decode_base_s: float = 0.02, decode_per_seq_s: float = 0.004,
                   decode_per_ctx_token_s: float = 1e-6, prefill_base_s: float = 0.01,
                   prefill_per_token_s: float = 2e-4, kv_tokens: int = 65536, max_num_seqs: int = 64,
                   transfer_per_mb_s: float = 0.001) -> TimingProfile:
    """Step times linear in their inputs: decode = base + per_seq x B + per_ctx x B x context;
    prefill = base + per_token x (new + context / 4)."""
    batches, contexts = [1.0, 8.0, 64.0], [0.0, 1024.0, 4096.0]
    news = [1.0, 256.0, 2048.0]
    return TimingProfile(
        device="formula", model="formula", weight_format="none", kv_bytes_per_token=46080, block_size=16,
        kv_tokens_per_worker=kv_tokens, max_num_seqs=max_num_seqs, prefill_chunk_size=None,
        prefill=Grid(xs=news, ys=contexts, zs=[[prefill_base_s + prefill_per_token_s * (n + c / 4) for c in contexts]
                                               for n in news]),
        decode=Grid(xs=batches, ys=contexts,
                    zs=[[decode_base_s + decode_per_seq_s * b + decode_per_ctx_token_s * b * c for c in contexts]
                        for b in batches]),
        transfer=Curve(xs=[0.0, 1e9], ys=[0.0005, 0.0005 + transfer_per_mb_s * 1000]))
