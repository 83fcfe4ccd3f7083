"""Prompt logprobs (``echo`` with ``logprobs`` on completions): each prompt token's log probability given
those before it, equal to HF's log-softmax over the same GGUF's logits, however the prompt is chunked, and
computed whole even where its blocks are in the prefix cache."""

from __future__ import annotations

import pytest
import torch

from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams

K = 3


def hf_prompt_logprobs(hf_model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Prompt token i + 1's log probability, and the top K (values, ids) at position i."""
    with torch.inference_mode():
        log_probs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0, :-1].float(), dim=-1)
    chosen = log_probs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    values, top_ids = log_probs.topk(K, dim=-1)
    return chosen, values, top_ids


@pytest.mark.parametrize("chunk", [2048, 48])
def test_prompt_logprobs_equal_hf(hf_reference, make_engine, prompt_ids, chunk) -> None:
    hf_model, _ = hf_reference
    engine = make_engine(dense=True, max_num_batched_tokens=chunk)
    prompts = [ids for ids in prompt_ids if 20 <= len(ids) <= 200][:2]
    assert prompts and any(len(ids) > chunk for ids in prompts) == (chunk == 48)
    outs = engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K))
    for ids, out in zip(prompts, outs, strict=True):
        chosen, values, top_ids = hf_prompt_logprobs(hf_model, ids)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids) - 1
        got = torch.tensor([lp for lp, _ in out.prompt_logprobs])
        assert (got - chosen).abs().max().item() < 2e-3
        got_values = torch.tensor([[v for _, v in top] for _, top in out.prompt_logprobs])
        assert (got_values - values).abs().max().item() < 2e-3
        # The likeliest token agrees wherever it is not a near-tie.
        clear = (values[:, 0] - values[:, 1]) > 1e-2
        got_first = torch.tensor([top[0][0] for _, top in out.prompt_logprobs])
        assert torch.equal(got_first[clear], top_ids[clear, 0])


def test_a_cached_prompt_is_computed_again_for_its_logprobs(make_engine, prompt_ids) -> None:
    engine = make_engine()
    ids = next(ids for ids in prompt_ids if len(ids) > 100)
    engine.generate([ids], SamplingParams(max_tokens=1, temperature=0.0))  # now cached
    hits_before = engine.stats().prefix_hit_tokens_total
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    first, second = (engine.generate([ids], params)[0] for _ in range(2))
    assert engine.stats().prefix_hit_tokens_total == hits_before  # neither used the cache
    assert first.prompt_logprobs is not None and len(first.prompt_logprobs) == len(ids) - 1
    assert first.prompt_logprobs == second.prompt_logprobs and all(top == [] for _, top in first.prompt_logprobs)
    assert engine.generate([ids], SamplingParams(max_tokens=1))[0].prompt_logprobs is None


def test_a_prefill_worker_does_not_take_prompt_logprobs(make_engine) -> None:
    engine = make_engine()
    for where in ({"prefill_only": True}, {"remote_prefill": True}):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            engine.add_request("Hello there", SamplingParams(prompt_logprobs=1), **where)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
