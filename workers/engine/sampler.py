"""Batched sampling: logit adjustments (penalties, logit_bias, min_tokens: ``penalties.py``), greedy,
temperature, top-k, top-p, min-p, per-request seeds.

Filters apply in HF's order: temperature, then top-k, then top-p, then min-p, each on the
distribution the previous one left (renormalized). A random row draws one uniform number from its own
``torch.Generator`` (``draw``) and inverts the CDF of its filtered distribution: an exact sample of
p from the same random numbers whatever else is in the batch, so a seeded request reproduces. (The
exponential race it replaced, argmax of p / Exp(1), drew one number per vocabulary entry: 75 ms a
step for 64 rows on this CPU, against ~4 ms.) On CPU the filters and the CDF run in one compiled call
(``kernels/sampling.py``), which picks the same token as the torch statement here (``sample_filtered``,
kept for other devices) without its whole-vocabulary sorts: a batch-8 decode step at top_p 0.9, 10.0 -> 4.4 ms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kernels import sampling
from kernels.fused_ops import argmax_rows
from workers.engine.penalties import apply_penalties
from workers.engine.structured_output import apply_grammar_masks
from workers.protocol.sampling_params import SamplingParams

# Top-p first looks among this many most likely tokens (``topk``, not a sort of the whole vocabulary:
# on a CPU a [64, 49152] sort took ~0.3 s, about as long as a decode step of the model). A row whose nucleus is wider
# than that falls back to the full sort, so the kept set is the same either way.
NUCLEUS_CANDIDATES = 1024


def apply_filters(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with filtered-out tokens at -inf. logits: [N, V] float32."""
    device = logits.device
    vocab = logits.shape[1]
    temps = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temps
    top_k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if top_k_rows:
        rows = torch.tensor(top_k_rows, device=device)
        ks = torch.tensor([params[i].top_k for i in top_k_rows], device=device)
        sub = logits[rows]
        kth = sub.topk(int(ks.max()), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
        logits[rows] = sub.masked_fill(sub < kth, float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        logits = logits.masked_fill(top_p_drop(logits.softmax(dim=-1), top_p), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def top_p_drop(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Tokens outside each row's nucleus: drop a token when the tokens strictly more likely already
    cover top_p (so at least one stays). probs: [N, V]; top_p: [N, 1] -> bool [N, V]."""
    drop, covered = _drop_past_nucleus(*probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[1]), dim=-1), probs, top_p)
    wide = (covered < top_p[:, 0]).nonzero().squeeze(1)
    if len(wide):
        drop[wide] = _drop_past_nucleus(*probs[wide].sort(dim=-1, descending=True), probs[wide], top_p[wide])[0]
    return drop


def _drop_past_nucleus(vals: torch.Tensor, idx: torch.Tensor, probs: torch.Tensor,
                       top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The drop mask from a row's likeliest tokens (``vals`` descending, token ids ``idx``), and the
    mass they cover. Every token not among them has at least that whole mass before it: dropped."""
    cum_before = vals.cumsum(dim=-1) - vals
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, idx, cum_before >= top_p)
    return drop, cum_before[:, -1] + vals[:, -1]


def top_logprobs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[list[tuple[int, float]] | None]:
    """Each row's ``top_logprobs`` likeliest tokens and their log-probabilities (the model's own, as
    ``sample`` reports the chosen token's), likeliest first; None for rows that ask for none."""
    out: list[list[tuple[int, float]] | None] = [None] * logits.shape[0]
    want = [i for i, p in enumerate(params) if p.top_logprobs]
    if want:
        rows = torch.tensor(want, device=logits.device)
        k = max(params[i].top_logprobs for i in want)
        values, ids = torch.log_softmax(logits[rows], dim=-1).topk(k, dim=-1)
        for i, vals, toks in zip(want, values.tolist(), ids.tolist(), strict=True):
            n = params[i].top_logprobs
            out[i] = list(zip(toks[:n], vals[:n], strict=True))
    return out


def sample_filtered(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """The torch statement of sampling (any device): each row's filtered distribution (``apply_filters``) through
    its CDF at u [N, 1] float64 -> [N] token ids."""
    probs = apply_filters(logits, params).softmax(dim=-1)
    cdf = probs.double().cumsum(dim=-1)
    # The first token whose cumulative mass passes u * total; a token of mass 0 never does.
    chosen = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    vocab = probs.shape[1]
    return torch.where(chosen < vocab, chosen, probs.argmax(dim=-1))  # u * total rounded up


def draw(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """The one random number a sampled token consumes: [1], uniform in [0, 1)."""
    return torch.rand(1, generator=generator, device=device)


def sample(
    logits: torch.Tensor,  # [N, V] float32
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompts: Sequence[Sequence[int]] = (),  # each row's prompt and output tokens so far: for the penalties
    outputs: Sequence[Sequence[int]] = (),
    eos_token_id: int | None = None,
    grammars: Sequence[Any | None] = (),  # each row's structured-output matcher, or None
) -> tuple[list[int], list[float | None]]:
    """Next token of every row and, where asked, the chosen token's log-probability.

    Log-probabilities are the model's own (before penalties, temperature and filters), as OpenAI and
    vLLM report them.
    """
    num_rows = logits.shape[0]
    if any(p.adjusts_logits for p in params):
        assert len(prompts) == len(outputs) == num_rows, "penalties need every row's prompt and output tokens"
        adjusted = apply_penalties(logits, params, prompts, outputs, eos_token_id)
    else:
        adjusted = logits
    if any(g is not None for g in grammars):
        adjusted = apply_grammar_masks(adjusted, grammars)
    token_ids = argmax_rows(adjusted)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        u = torch.stack([draw(generators[i], logits.device) for i in random_rows]).double()
        chosen_params = [params[i] for i in random_rows]
        if sampling.supported(adjusted):  # one compiled call, where the torch path below takes ~1 ms a row of top-p
            sub = adjusted if len(random_rows) == num_rows else adjusted[rows]  # every row sampled: no copy
            token_ids[rows] = sampling.sample_rows(
                sub, [p.temperature for p in chosen_params], [p.top_k for p in chosen_params],
                [p.top_p for p in chosen_params], [p.min_p for p in chosen_params], u)
        else:
            token_ids[rows] = sample_filtered(adjusted[rows], chosen_params, u)
    logprobs: list[float | None] = [None] * num_rows
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:
        rows = torch.tensor(want, device=logits.device)
        chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, token_ids[rows].unsqueeze(1)).squeeze(1)
        for i, lp in zip(want, chosen.tolist(), strict=True):
            logprobs[i] = lp
    return token_ids.tolist(), logprobs
