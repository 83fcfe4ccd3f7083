"""The timing-model worker: the real engine around a model that only takes the profile's time."""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from tests.cluster.profiles import linear_profile
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.timing_model import TimingModel
from workers.protocol.sampling_params import SamplingParams
from workers.transport.paced import PacedTransport
from workers.transport.tcp import TcpTransport


@pytest.fixture
def sim_engine(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    profile = linear_profile(decode_base_s=0.01, decode_per_seq_s=0.002, prefill_base_s=0.005,
                             prefill_per_token_s=1e-4)
    timing = TimingModel(model.config, profile)
    return Engine(EngineConfig(num_kv_blocks=512, timing_profile=profile), model=timing, tokenizer=tokenizer)


def test_steps_take_the_profiles_time(sim_engine):
    profile = sim_engine.model.profile
    prompts = [[1000 + i] * 100 for i in range(4)]
    for p in prompts:
        sim_engine.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True))
    started = time.perf_counter()
    first = sim_engine.step()  # the four prompts in one step
    prefill_s = time.perf_counter() - started
    assert len(first.outputs) == 4
    times = []
    while sim_engine.has_unfinished:
        started = time.perf_counter()
        sim_engine.step()
        times.append(time.perf_counter() - started)
    expected_prefill = 4 * profile.prefill_s(100, 0)
    assert expected_prefill <= prefill_s < expected_prefill + 0.05
    expected_decode = profile.decode_step_s(4, 110)
    assert len(times) == 19 and expected_decode - 0.001 <= statistics.median(times) < expected_decode + 0.01


def test_tokens_are_ordinary_deterministic_and_obey_sampling_settings(sim_engine):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    hot = SamplingParams(max_tokens=12, temperature=1.5, top_p=0.9, seed=3, ignore_eos=True)
    a, b, c = sim_engine.generate(["Hello there", "Hello there", "Hello there"], [greedy, greedy, hot])
    assert a.token_ids == b.token_ids == c.token_ids and len(a.token_ids) == 12
    assert all(t >= 1000 for t in a.token_ids) and a.finish_reason == "length"
    assert sim_engine.runner.kv_cache.shape[0] == 1 and sim_engine.runner.kv_cache.numel() == 2 * 512 * 16


def test_a_paced_transfer_takes_the_time_of_the_real_models_bytes():
    profile = linear_profile(transfer_per_mb_s=0.05)  # 20 GB/s... per MB: 50 ms
    source, sink = PacedTransport(TcpTransport(), profile, 16), PacedTransport(TcpTransport(), profile, 16)
    source.register(torch.arange(2 * 64 * 16, dtype=torch.float32).view(1, 2, 64, 16, 1, 1).contiguous())
    received = torch.zeros(1, 2, 64, 16, 1, 1)
    sink.register(received)
    try:
        result = source.write_blocks(sink.address(), [3, 4], [10, 11], "r1", timeout_s=10.0)
    finally:
        source.close()
        sink.close()
    assert result.num_bytes == 2 * 16 * 46080  # what the real model's two blocks hold
    assert result.seconds >= profile.transfer_s(result.num_bytes) == pytest.approx(0.0005 + 0.05 * 1.47456)
    assert torch.equal(received[:, :, 10:12], torch.arange(2 * 64 * 16).float().view(1, 2, 64, 16, 1, 1)[:, :, 3:5])
