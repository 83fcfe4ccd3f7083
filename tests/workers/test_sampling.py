"""Sampling: seeds reproduce whatever the batch; filters sample the right renormalized distribution; the compiled CPU
sampler picks the torch path's token."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_kernel, sampling
from tests.tiny_model import tiny_model
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.engine.sampler import sample, sample_filtered
from workers.protocol.sampling_params import SamplingParams

NUM_DRAWS = 20000


@pytest.fixture(scope="module")
def tiny_engine_factory(default_model_and_tokenizer):
    _, tokenizer = default_model_and_tokenizer
    model = tiny_model(seed=3)

    def make(**knobs):
        return Engine(EngineConfig(num_kv_blocks=256, **knobs), model=model, tokenizer=tokenizer)

    return make


def reference_distribution(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Independent, sort-based statement of HF's order: temperature, top-k, top-p, min-p."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep[order[: p.top_k if p.top_k > 0 else len(probs)]] = True
    probs = torch.where(keep, probs, 0.0)
    probs /= probs.sum()
    if p.top_p < 1.0:
        total, kept = 0.0, torch.zeros_like(keep)
        for t in probs.argsort(descending=True).tolist():
            if total >= p.top_p:
                break
            kept[t] = True
            total += probs[t].item()
        probs = torch.where(kept, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=12),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.9, min_p=0.05),
], ids=["top_k", "top_p", "min_p", "all"])
def test_filters_sample_the_renormalized_distribution(params):
    model = tiny_model(seed=1, vocab_size=512)
    # logits of a real (random) model at one position
    logits = full_logits(model, [5, 17, 42, 7])
    expected = reference_distribution(logits, params)
    batch = logits.expand(NUM_DRAWS, -1).contiguous()
    gens = [torch.Generator().manual_seed(i) for i in range(NUM_DRAWS)]
    tokens, _ = sample(batch, [params] * NUM_DRAWS, gens)
    counts = torch.bincount(torch.tensor(tokens), minlength=len(expected)).double()
    support = expected > 0
    assert counts[~support].sum() == 0, "sampled a token the filters removed"
    assert 2 <= int(support.sum()) <= 60
    # Pearson chi-square over the support; the 99.9% quantile of chi2(df) is below df + 3.1 sqrt(2 df) + 10
    exp_counts = expected[support] * NUM_DRAWS
    chi2 = (((counts[support] - exp_counts) ** 2) / exp_counts).sum().item()
    df = int(support.sum()) - 1
    assert chi2 < df + 3.1 * (2 * df) ** 0.5 + 10, (chi2, df)


def test_seeded_requests_reproduce_whatever_the_batch(tiny_engine_factory):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = tiny_engine_factory().generate([[3, 4, 5, 6, 7]], params)[0].token_ids
    others = [SamplingParams(max_tokens=m, temperature=0.8, ignore_eos=True) for m in (5, 30, 12)]
    crowd = tiny_engine_factory(max_num_batched_tokens=64).generate(
        [[9, 9, 9], [3, 4, 5, 6, 7], [1] * 40, [8, 7]], [others[0], params, others[1], others[2]])
    assert crowd[1].token_ids == alone
    different_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True)
    assert tiny_engine_factory().generate([[3, 4, 5, 6, 7]], different_seed)[0].token_ids != alone


def test_greedy_logprobs_are_log_softmax_of_chosen(tiny_engine_factory):
    engine = tiny_engine_factory()
    res = engine.generate([[3, 4, 5]], SamplingParams(max_tokens=1, temperature=0, logprobs=True))[0]
    logits = full_logits(engine.model, [3, 4, 5])
    assert res.token_ids[0] == int(logits.argmax())
    assert res.logprobs[0] == pytest.approx(torch.log_softmax(logits, -1).max().item(), abs=1e-5)


def full_logits(model, ids: list[int]) -> torch.Tensor:
    from tests.workers.test_engine_vs_hf import full_prefill_logits

    return full_prefill_logits(model, ids)[-1]


def test_top_p_over_candidates_keeps_what_a_full_sort_keeps():
    """Peaked rows (nucleus inside the top-k candidates) and flat ones (wider: the full-sort fallback),
    over a real-sized vocabulary, against the whole-vocabulary sort."""
    from workers.engine.sampler import NUCLEUS_CANDIDATES, top_p_drop

    g = torch.Generator().manual_seed(0)
    vocab = 49152
    scales = torch.tensor([8.0, 4.0, 2.0, 0.3, 0.05, 0.0])  # logit spread: peaked ... uniform
    probs = (torch.randn(len(scales), vocab, generator=g) * scales[:, None]).softmax(dim=-1)
    top_p = torch.tensor([[0.9], [0.5], [0.95], [0.8], [0.99], [0.3]])
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    expected = torch.zeros_like(probs, dtype=torch.bool).scatter(1, order, before >= top_p)
    got = top_p_drop(probs, top_p)
    assert torch.equal(got, expected)
    kept = (~got).sum(dim=-1)
    assert kept.min() <= NUCLEUS_CANDIDATES < kept.max()  # both paths ran


@pytest.mark.parametrize("knobs", [dict(temperature=0.7), dict(logprobs=True), dict(logprobs=True, top_logprobs=2),
                                   dict(repetition_penalty=1.3), dict(logit_bias=[(4, 50.0)]), dict(min_tokens=3)])
def test_argmax_fast_path_only_for_batches_of_plain_greedy_rows(tiny_engine_factory, knobs):
    """A batch of plain greedy rows samples by one argmax; one row asking the sampler for more puts the whole
    batch back through ``sample``, and its request gets what it asked for beside a plain one."""
    from workers.engine.request import Request

    plain = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    other = SamplingParams(max_tokens=6, ignore_eos=True, **{"temperature": 0, **knobs})
    assert Request("a", [1], plain).plain_greedy and not Request("b", [1], other).plain_greedy
    prompts = [[3, 4, 5], [7, 8, 9, 10]]
    alone = tiny_engine_factory().generate(prompts[:1], plain)[0].token_ids
    together = tiny_engine_factory().generate(prompts, [plain, other])
    assert together[0].token_ids == alone  # the plain row's argmax, whichever path sampled it
    if other.logprobs:
        assert len(together[1].logprobs) == 6 and all(lp <= 0 for lp in together[1].logprobs)
        assert len(together[1].top_logprobs) == (6 if other.top_logprobs else 0)
    if knobs.get("logit_bias"):
        assert together[1].token_ids == [4] * 6  # the bias outweighs the model


@pytest.fixture(scope="module")
def compiled_sampler() -> None:
    if not sampling.supported(torch.zeros(1, 1)):
        pytest.skip(f"the CPU kernels cannot be built here: {cpu_kernel.unavailable_reason()}")


def compiled(logits: torch.Tensor, p: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    return sampling.sample_rows(logits, [p.temperature] * n, [p.top_k] * n, [p.top_p] * n, [p.min_p] * n, u)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=0.8, top_k=40), SamplingParams(temperature=1.2, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02),
    SamplingParams(temperature=0.6, top_p=0.5), SamplingParams(temperature=1.0, top_k=1),
    SamplingParams(temperature=1.0, top_p=1e-6), SamplingParams(temperature=2.0, min_p=1.0),
], ids=["temperature", "top_p", "top_k", "min_p", "all", "top_p_half", "top_k_1", "top_p_tiny", "min_p_1"])
def test_the_compiled_sampler_picks_the_torch_paths_token(compiled_sampler, params):
    """kernels/csrc/sampling_cpu.cpp against sample_filtered (the torch statement) with the same uniform numbers, on
    rows of a real vocabulary's size from peaked to flat, some tokens masked to -inf: the same token every time here
    (the two may part where a boundary falls within a rounding of top_p or of a CDF step; none does in these rows)."""
    g = torch.Generator().manual_seed(7)
    spread = torch.tensor([[0.5], [1.0], [2.0], [4.0], [8.0], [16.0]])
    logits = torch.randn(6, 49152, generator=g) * spread
    logits[1, :300] = float("-inf")
    logits[4, 1000:] = float("-inf")
    for _ in range(40):
        u = torch.rand(6, 1, generator=g, dtype=torch.float64)
        want = sample_filtered(logits, [params] * 6, u)
        got = compiled(logits, params, u)
        assert torch.equal(got, want), (got.tolist(), want.tolist())


def test_the_compiled_sampler_keeps_ties_in_token_order_and_never_a_masked_token(compiled_sampler):
    """Equal logits: top-p 0.5 keeps the first half in token order (a sort's order among equals is its own), and
    draws them evenly; a token at -inf is never drawn, and a row with one token left draws it."""
    flat = torch.zeros(1, 1000)
    draws = compiled(flat.expand(4000, -1).contiguous(), SamplingParams(temperature=1.0, top_p=0.5),
                     torch.rand(4000, generator=torch.Generator().manual_seed(1), dtype=torch.float64))
    assert draws.max() < 500 and draws.min() >= 0
    assert torch.bincount(draws // 100, minlength=5).min() > 600  # five bands of 100 tokens, ~800 each
    masked = torch.full((3, 64), float("-inf"))
    masked[0, 17] = 3.0
    masked[1, [5, 40]] = 0.0
    masked[2, 63] = -2.0
    got = compiled(masked, SamplingParams(temperature=0.5, top_p=0.99, min_p=0.1), torch.tensor([0.0, 0.99, 0.5],
                                                                                              dtype=torch.float64))
    assert got.tolist() == [17, 40, 63]


def test_the_compiled_sampler_refuses_a_greedy_row(compiled_sampler):
    with pytest.raises(RuntimeError, match="temperature must be > 0"):
        compiled(torch.zeros(1, 8), SamplingParams(temperature=0.0), torch.zeros(1, dtype=torch.float64))
