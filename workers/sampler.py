"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Filters apply in HF's order: temperature, then top-k, then top-p, then min-p, each on the
distribution the previous one left (renormalized). A random row draws with its own
``torch.Generator`` through the exponential race (argmax of p / Exp(1)), which samples exactly from
p and consumes the same random numbers whatever else is in the batch: a seeded request reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.sampling_params import SamplingParams


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with filtered-out tokens at -inf. logits: [N, V] float32."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    if any(top_ks):
        k = torch.tensor([k or logits.shape[1] for k in top_ks], device=device).clamp(max=logits.shape[1])
        sorted_desc = logits.sort(dim=-1, descending=True).values
        kth = sorted_desc.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        probs_sorted, idx = logits.softmax(dim=-1).sort(dim=-1, descending=True)
        # Drop a token when the tokens strictly more likely already cover top_p (keeps at least one).
        cum_before = probs_sorted.cumsum(dim=-1) - probs_sorted
        drop_sorted = cum_before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[float | None]]:
    """Next token of every row and, where asked, the chosen token's log-probability.

    Log-probabilities are the model's own (before temperature and filters), as OpenAI reports them.
    """
    num_rows = logits.shape[0]
    token_ids = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = apply_filters(logits[rows], [params[i] for i in random_rows]).softmax(dim=-1)
        noise = torch.empty_like(probs)
        for j, i in enumerate(random_rows):
            noise[j].exponential_(generator=generators[i])
        token_ids[rows] = (probs / noise).argmax(dim=-1)
    logprobs: list[float | None] = [None] * num_rows
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        rows = torch.tensor(want, device=logits.device)
        chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)
        for i, lp in zip(want, chosen.tolist(), strict=True):
            logprobs[i] = lp
    return token_ids.tolist(), logprobs
