"""Logit adjustments a request asks for, before temperature and the filters, in vLLM's order and with its
definitions (so clients see what they see there):

1. ``min_tokens``: EOS (unless ``ignore_eos``) and ``stop_token_ids`` get -inf while fewer output tokens
   than that are out;
2. ``logit_bias``: added to the named tokens' logits;
3. ``repetition_penalty`` r, over every token seen in the prompt or the output: a logit l > 0 becomes
   l / r, any other l * r;
4. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's definitions), over output tokens:
   l -= f * count + p * (count > 0).

Greedy rows are adjusted too (the argmax moves). Rows asking for nothing are left alone; the others are
adjusted together with scatters over [rows, vocab] tensors, so a step's cost does not grow with a loop
over the vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.protocol.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                    outputs: Sequence[Sequence[int]], eos_token_id: int | None) -> torch.Tensor:
    """logits [N, V] float32 -> adjusted logits (the input itself when no row asks for anything)."""
    idx = [i for i, p in enumerate(params) if p.adjusts_logits]
    if not idx:
        return logits
    device, vocab = logits.device, logits.shape[1]
    logits = logits.clone()
    sub = logits[torch.tensor(idx, device=device)]
    chosen = [params[i] for i in idx]

    held_rows, held_ids = _pairs([
        [*p.stop_token_ids, *([eos_token_id] if eos_token_id is not None and not p.ignore_eos else [])]
        if len(outputs[i]) < p.min_tokens else [] for i, p in zip(idx, chosen, strict=True)], vocab)
    bias_rows, bias_ids = _pairs([[t for t, _ in p.logit_bias] for p in chosen], vocab)
    biases = [float(b) for p in chosen for t, b in p.logit_bias if t < vocab]
    if biases:
        sub.index_put_((bias_rows.to(device), bias_ids.to(device)), torch.tensor(biases, device=device),
                       accumulate=True)
    if len(held_rows):
        sub[held_rows.to(device), held_ids.to(device)] = float("-inf")

    out_rows, out_ids = _pairs([outputs[i] for i in idx], vocab)
    counts = torch.zeros_like(sub)
    counts.index_put_((out_rows.to(device), out_ids.to(device)), torch.ones(len(out_ids), device=device),
                      accumulate=True)
    if any(p.repetition_penalty != 1.0 for p in chosen):
        seen = counts > 0
        prompt_rows, prompt_ids = _pairs([prompts[i] for i in idx], vocab)
        seen[prompt_rows.to(device), prompt_ids.to(device)] = True
        r = torch.tensor([p.repetition_penalty for p in chosen], device=device).unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    frequency = torch.tensor([p.frequency_penalty for p in chosen], device=device).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in chosen], device=device).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0)
    logits[torch.tensor(idx, device=device)] = sub
    return logits


def _pairs(ids_per_row: Sequence[Sequence[int]], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token id) index tensors for every id below ``vocab`` of every row."""
    rows = [r for r, ids in enumerate(ids_per_row) for t in ids if t < vocab]
    cols = [t for ids in ids_per_row for t in ids if t < vocab]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long)
