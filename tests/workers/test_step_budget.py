"""A step's token budget where the config sets none: 1,024 tokens on CPU, 8,192 on CUDA
(``workers/engine/config.py``), and what it does to a burst of prompts: served in turn, not in one long step."""

from __future__ import annotations

import random

from cluster.cluster_sim import SimSpec, simulate
from tests.cluster.profiles import linear_profile
from workers.engine.config import EngineConfig, default_step_tokens
from workers.engine.engine import Engine
from workers.model.timing_model import TimingModel
from workers.protocol.sampling_params import SamplingParams

BURST = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def burst_prompts(count: int, length: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[1] + [rng.randrange(200, 40000) for _ in range(length - 1)] for _ in range(count)]


def first_token_steps(engine, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
    """The step at which each request got its first token, and every step's token count."""
    ids = [engine.add_request(p, BURST) for p in prompts]
    first: dict[str, int] = {}
    tokens = []
    while engine.has_unfinished:
        result = engine.step()
        tokens.append(result.num_tokens)
        for out in result.outputs:
            first.setdefault(out.request_id, len(tokens))
    return [first[i] for i in ids], tokens


def test_the_default_budget_follows_the_device():
    assert default_step_tokens("cpu") == 1024
    assert default_step_tokens("cuda") == 8192


def test_a_cpu_engine_prefills_a_burst_in_turn(make_engine):
    prompts = burst_prompts(5, 300)
    engine = make_engine()
    assert engine.scheduler.token_budget == 1024
    firsts, tokens = first_token_steps(engine, prompts)
    assert max(tokens) <= 1024
    assert firsts == sorted(firsts) and firsts[0] < firsts[-1]  # first come, first served, and not together
    assert engine.block_pool.num_used_blocks == 0

    roomy = make_engine(max_num_batched_tokens=8192)  # a set budget wins: the whole burst in one step
    assert roomy.scheduler.token_budget == 8192
    firsts, tokens = first_token_steps(roomy, prompts)
    assert firsts == [1] * len(prompts) and tokens[0] == 5 * 300


def test_a_timing_model_steps_with_the_budget_of_its_profiles_device():
    """``tandem serve --sim`` and ``tandem plan``: a GPU profile's worker batches as a GPU worker would."""
    burst = [(0.0, 400, 4)] * 10
    first_tokens = {}
    for device in ("cpu: 2 threads", "cuda: NVIDIA H100"):
        profile = linear_profile().model_copy(update={"device": device})
        result = simulate(profile, SimSpec(rate=1.0, input_len=1, output_len=1), 0, 1, trace=burst)
        first_tokens[device.split(":")[0]] = sorted(result.ttfts())
    # The first arrival starts a step alone (as on a worker); the other nine wait for it.
    cpu, cuda = first_tokens["cpu"][1:], first_tokens["cuda"][1:]
    assert len(set(cuda)) == 1  # one step of 3,600 tokens
    assert cpu[0] < cuda[0] and len(set(cpu)) > 1


def test_a_timing_model_engine_takes_its_profiles_budget(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    for device, budget in (("cuda: NVIDIA H100", 8192), ("cpu: 2 threads", 1024)):
        profile = linear_profile().model_copy(update={"device": device})
        engine = Engine(EngineConfig(num_kv_blocks=64, timing_profile=profile),
                        model=TimingModel(model.config, profile), tokenizer=tokenizer)
        assert engine.scheduler.token_budget == budget
