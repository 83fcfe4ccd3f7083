"""Workloads are seeded and reproducible; arrivals follow their distributions; lengths are exact."""

from __future__ import annotations

import math
import random

import pytest

from loadgen.client import ClientConfig, request_body
from loadgen.tokens import TokenText, WordTokenizer
from loadgen.workload import LengthSpec, WorkloadSpec, arrival_times, build_workload


def ks_statistic_exponential(samples, rate):
    xs = sorted(samples)
    n = len(xs)
    return max(max((i + 1) / n - (1 - math.exp(-rate * x)), (1 - math.exp(-rate * x)) - i / n)
               for i, x in enumerate(xs))


def test_poisson_gaps_pass_a_ks_test():
    times = arrival_times("poisson", 4.0, 5000, random.Random(1))
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    # 5% critical value of the one-sample KS test: 1.36 / sqrt(n)
    assert ks_statistic_exponential(gaps, 4.0) < 1.36 / math.sqrt(len(gaps))
    # and a wrong rate fails it, so the test can fail
    assert ks_statistic_exponential(gaps, 3.0) > 1.36 / math.sqrt(len(gaps))


def test_gamma_burstiness_and_constant():
    times = arrival_times("gamma", 2.0, 20000, random.Random(2), cv=3.0)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(0.5, rel=0.1) and sd / mean == pytest.approx(3.0, rel=0.15)
    assert arrival_times("constant", 4.0, 3, random.Random(0)) == [0.0, 0.25, 0.5]


def test_length_specs(tmp_path):
    rng = random.Random(0)
    assert LengthSpec.parse("64").sample(rng, 0) == 64
    assert all(10 <= LengthSpec.parse("uniform:10:20").sample(rng, i) <= 20 for i in range(100))
    lognormal = [LengthSpec.parse("lognormal:200:60").sample(rng, i) for i in range(20000)]
    assert sum(lognormal) / len(lognormal) == pytest.approx(200, rel=0.03)
    f = tmp_path / "lens.jsonl"
    f.write_text('{"n": 5}\n{"n": 7}\n')
    spec = LengthSpec.parse(f"jsonl:{f}:n")
    assert [spec.sample(rng, i) for i in range(3)] == [5, 7, 5]
    for bad in ("uniform:5", "zipf:1:2", "uniform:9:1", "abc"):
        with pytest.raises(ValueError, match="bad length spec"):
            LengthSpec.parse(bad)


def test_same_seed_same_schedule_and_prompts():
    spec = WorkloadSpec(num_requests=20, input_len=LengthSpec.parse("uniform:5:30"),
                        output_len=LengthSpec.parse("uniform:4:9"), rate=3.0, prefix_groups=2, prefix_len=16,
                        turns=2, seed=7)
    text = TokenText(WordTokenizer())
    a, b = build_workload(spec, text), build_workload(spec, text)
    assert [(p.arrival_s, p.system, p.turns, p.max_tokens) for p in a] == \
           [(p.arrival_s, p.system, p.turns, p.max_tokens) for p in b]
    c = build_workload(WorkloadSpec(**{**spec.__dict__, "seed": 8}), text)
    assert [p.turns for p in a] != [p.turns for p in c]
    assert {p.system for p in a} == {a[0].system, a[1].system} and a[0].system != a[1].system
    assert all(len(p.turns) == 2 for p in a)


def test_prompt_lengths_exact_with_the_model_tokenizer(default_model_and_tokenizer):
    hf_tokenizer = default_model_and_tokenizer[1].hf
    text = TokenText(hf_tokenizer)
    rng = random.Random(0)
    for n in (1, 7, 64, 300):
        assert len(hf_tokenizer.encode(text.exact(n, rng), add_special_tokens=False)) == n


def test_open_ended_share_leaves_the_rest_of_the_workload_as_it_was():
    spec = WorkloadSpec(num_requests=400, input_len=LengthSpec.parse("uniform:5:30"),
                        output_len=LengthSpec.parse("uniform:4:9"), rate=3.0, seed=3)
    text = TokenText(WordTokenizer())
    closed = build_workload(spec, text)
    mixed = build_workload(WorkloadSpec(**{**spec.__dict__, "open_ended": 0.25}), text)
    assert [(p.arrival_s, p.turns) for p in closed] == [(p.arrival_s, p.turns) for p in mixed]
    open_ended = [p for p in mixed if p.max_tokens is None]
    assert 0.18 < len(open_ended) / len(mixed) < 0.32
    assert all(m.max_tokens in (None, c.max_tokens) for c, m in zip(closed, mixed, strict=True))
    cfg = ClientConfig("http://x", "m")
    assert "max_tokens" not in request_body(cfg, [], None) and "ignore_eos" not in request_body(cfg, [], None)
    assert request_body(cfg, [], 8)["max_tokens"] == 8 and request_body(cfg, [], 8)["ignore_eos"]
    assert request_body(cfg, [], 8)["temperature"] == 0.0 and "top_p" not in request_body(cfg, [], 8)
    sampled = request_body(ClientConfig("http://x", "m", temperature=0.7, top_p=0.9), [], 8)
    assert (sampled["temperature"], sampled["top_p"]) == (0.7, 0.9)
    with pytest.raises(ValueError, match="open-ended share"):
        WorkloadSpec(num_requests=1, input_len=LengthSpec.parse("4"), output_len=LengthSpec.parse("4"),
                     open_ended=1.5)
