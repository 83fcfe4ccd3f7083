"""Penalties, logit_bias and min_tokens against a reference written here from vLLM's definitions (a plain
loop over rows and tokens), then in the engine: min_tokens holds EOS back, greedy rows move too."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine.penalties import apply_penalties
from workers.engine.sampler import sample, top_logprobs
from workers.protocol.errors import InvalidRequestError
from workers.protocol.sampling_params import SamplingParams

VOCAB, EOS = 50, 2


def reference(logits: torch.Tensor, params: list[SamplingParams], prompts: list[list[int]],
              outputs: list[list[int]], eos: int) -> torch.Tensor:
    """vLLM: min_tokens and logit_bias first, then repetition (prompt + output), frequency and presence
    (output only), one token at a time."""
    out = logits.clone().double()
    for r, p in enumerate(params):
        if len(outputs[r]) < p.min_tokens:
            for t in [*p.stop_token_ids, *([] if p.ignore_eos else [eos])]:
                out[r, t] = float("-inf")
        for t, bias in p.logit_bias:
            out[r, t] += bias
        for t in range(VOCAB):
            count = outputs[r].count(t)
            if t in prompts[r] or count:
                out[r, t] = out[r, t] / p.repetition_penalty if out[r, t] > 0 else out[r, t] * p.repetition_penalty
            out[r, t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out.float()


def test_adjustments_match_the_reference() -> None:
    rng = random.Random(0)
    params = [
        SamplingParams(),  # asks for nothing: untouched
        SamplingParams(presence_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(repetition_penalty=1.3, temperature=0.0),
        SamplingParams(repetition_penalty=0.7, presence_penalty=-1.0, frequency_penalty=-0.25),
        SamplingParams(logit_bias=[(3, 100.0), (7, -30.5), (3, -0.5)], min_tokens=4, stop_token_ids=[9]),
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[11, 12]),  # EOS not held: not a stop
        SamplingParams(min_tokens=3, max_tokens=5),  # 3 tokens out already: nothing held
    ]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))] for _ in params]
    outputs = [[rng.randrange(VOCAB) for _ in range(n)] for n in (5, 9, 4, 12, 1, 0, 3)]
    logits = torch.randn(len(params), VOCAB) * 4
    got = apply_penalties(logits, params, prompts, outputs, EOS)
    want = reference(logits, params, prompts, outputs, EOS)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert torch.equal(got[0], logits[0])
    assert got[4, EOS] == float("-inf") and got[4, 9] == float("-inf")
    assert got[5, 11] == float("-inf") and got[5, EOS] != float("-inf")
    assert not torch.isinf(got[6]).any()
    assert apply_penalties(logits, [SamplingParams()] * 7, prompts, outputs, EOS) is logits  # no copy when idle


def test_greedy_rows_follow_the_adjusted_logits() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 3.0
    params = [SamplingParams(temperature=0.0, logit_bias=[(8, 10.0)]), SamplingParams(temperature=0.0)]
    tokens, _ = sample(logits, params, [None, None], [[1], [1]], [[], []], EOS)
    assert tokens == [8, 5]


def test_invalid_settings_are_refused_by_name() -> None:
    for kwargs, name in [({"presence_penalty": 2.5}, "presence_penalty"), ({"repetition_penalty": 0.0},
                         "repetition_penalty"), ({"logit_bias": [(-1, 1.0)]}, "logit_bias"),
                         ({"logit_bias": [(1, 101.0)]}, "logit_bias"), ({"min_tokens": 20}, "min_tokens")]:
        with pytest.raises(InvalidRequestError, match=name):
            SamplingParams(**kwargs)


def test_min_tokens_holds_eos_back_in_the_engine(make_engine) -> None:
    engine = make_engine()
    eos = engine.tokenizer.eos_token_id
    prompt = "The capital of France is"
    # EOS made the likeliest token by far: without min_tokens the answer ends at once.
    pushed = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=[(eos, 100.0)])
    assert engine.generate([prompt], pushed)[0].token_ids == [eos]
    held = engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=[(eos, 100.0)],
                                                    min_tokens=6))[0]
    assert len(held.token_ids) == 7 and eos not in held.token_ids[:6] and held.token_ids[6] == eos
    with pytest.raises(InvalidRequestError, match="logit_bias token ids"):
        engine.add_request(prompt, SamplingParams(logit_bias=[(10**6, 1.0)]))


def test_penalties_change_greedy_text_as_the_reference_does(make_engine) -> None:
    """A repetitive prompt: the penalized greedy continuation repeats fewer of its tokens."""
    engine = make_engine()
    prompt = "one two one two one two one two one two"
    plain = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))[0].token_ids
    penalized = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, frequency_penalty=2.0,
                                                         presence_penalty=2.0))[0].token_ids
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain))


def test_top_logprobs_are_the_rows_log_softmax() -> None:
    logits = torch.randn(3, VOCAB) * 3
    params = [SamplingParams(logprobs=True, top_logprobs=20), SamplingParams(),
              SamplingParams(logprobs=True, top_logprobs=1)]
    got = top_logprobs(logits, params)
    values, ids = torch.log_softmax(logits, dim=-1).topk(20, dim=-1)
    assert got[0] == list(zip(ids[0].tolist(), values[0].tolist(), strict=True))
    assert got[1] is None and got[2] == [(ids[2, 0].item(), values[2, 0].item())]


def test_top_logprobs_are_the_models_log_softmax(make_engine) -> None:
    """Each token's alternatives against the log-softmax of one full prefill of the text before it (the fp32
    weights: prefill and decode kernels agree there to rounding; on Q4_1 blocks the 8-bit activations
    amplify the difference between them to ~0.1)."""
    from tests.workers.test_engine_vs_hf import full_prefill_logits

    engine = make_engine(dense=True)
    prompt = engine.tokenizer.encode("The three primary colours are")
    out = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True,
                                                   top_logprobs=20))[0]
    assert len(out.top_logprobs) == 5
    logits = full_prefill_logits(engine.model, prompt + out.token_ids[:-1])[len(prompt) - 1:]
    ref_values, ref_ids = torch.log_softmax(logits.float(), dim=-1).topk(20, dim=-1)
    for k, top in enumerate(out.top_logprobs):
        ids, values = [t for t, _ in top], torch.tensor([lp for _, lp in top])
        assert (values - ref_values[k]).abs().max() < 1e-3
        assert ids[0] == out.token_ids[k] and ids[:10] == ref_ids[k, :10].tolist()
        assert out.logprobs[k] == values[0].item()
