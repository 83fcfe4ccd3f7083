"""A model that takes the time a profile says and computes nothing: the timing-model worker
(``tandem serve --sim PROFILE``) runs the real engine (scheduler, block pool, prefix cache, KV events,
transfers) around it, so the control plane can be run and tested with 32+ workers on one small machine.

    model = TimingModel(opened.config, profile)
    logits = model.forward(input_ids, positions, kv_cache, attn, logits_indices)   # sleeps, then one-hot rows

Each step takes ``profile.step_s`` of what it was given (decode rows at their contexts, prompt chunks
after their cached tokens), the engine's own work between back-to-back steps included, and returns
logits that pick a cheap deterministic token: one that depends only on the row's input token and
position, never a special token (no EOS: a request runs to its max_tokens or a stop rule). Its KV
cache has the real block count and one float per (block, layer): transfers carry block lists of the
real length, and the transport paces them to the profile's time for the real bytes
(``workers.transport.paced``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from workers.model.attention_metadata import AttentionMetadata
from workers.model.compute_starts import compute_starts
from workers.model.config import ModelConfig
from workers.protocol.timing_profile import TimingProfile

_FIRST_ORDINARY_TOKEN = 1000  # below: control and byte tokens in the vocabularies Tandem serves


class TimingModel:
    def __init__(self, config: ModelConfig, profile: TimingProfile, sleep: Callable[[float], None] = time.sleep):
        self.config = config
        self.profile = profile
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self._sleep = sleep
        self._span = max(1, min(config.vocab_size, 40000) - _FIRST_ORDINARY_TOKEN)
        self._last_end: float | None = None

    def new_kv_cache(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        # [layers=1, K/V, blocks, block_size, kv_heads=1, head_dim=1]: the layout transports expect, 8 bytes a
        # token whatever the dtype (no real K or V is kept)
        return torch.zeros(1, 2, num_blocks, block_size, 1, 1)

    def step_seconds(self, attn: AttentionMetadata) -> float:
        """What the profiled engine takes for this step."""
        decode_contexts = attn.decode_seq_lens.tolist()
        starts = attn.prefill_query_start_loc.tolist()
        new = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        chunks = [(n, s - n) for n, s in zip(new, attn.prefill_seq_lens.tolist(), strict=True)]
        return self.profile.step_s(decode_contexts, chunks)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        logits_indices: torch.Tensor,  # [N] rows whose next token is sampled
    ) -> torch.Tensor:  # [N, vocab] float32
        started = time.perf_counter()
        rows = logits_indices.long()
        tokens = _FIRST_ORDINARY_TOKEN + (input_ids[rows] * 7919 + positions[rows] * 104729) % self._span
        logits = torch.zeros(len(rows), self.config.vocab_size)
        logits[torch.arange(len(rows)), tokens] = 100.0  # any sampler settings pick this token
        step_s = self.step_seconds(attn)
        # The profile timed whole engine steps (scheduling, sampling, detokenizing included), and this engine
        # spends that time too: back-to-back steps take the engine's time since the last forward off the sleep.
        outside = 0.0 if self._last_end is None else started - self._last_end
        outside = outside if outside < 0.5 * step_s else 0.0  # a longer gap: the engine was idle
        compute_starts()  # the modelled layers start (compute_starts.py)
        self._sleep(max(0.0, step_s - outside - (time.perf_counter() - started)))
        self._last_end = time.perf_counter()
        return logits
