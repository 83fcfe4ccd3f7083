"""A decode step's tokens reach the worker's event loop as the next step's layers start (while they run without
the GIL, workers/model/compute_starts.py), or at once when no step follows: never a step late."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.cluster.profiles import linear_profile
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.model.timing_model import TimingModel
from workers.protocol.messages import GenerateRequest
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.transport.tcp import TcpTransport

pytestmark = pytest.mark.asyncio
STEP_S = 0.08  # each step of the timing model


async def test_each_steps_tokens_arrive_as_the_next_step_starts_and_the_last_at_once(default_model_and_tokenizer):
    model, tokenizer = default_model_and_tokenizer
    profile = linear_profile(decode_base_s=STEP_S, decode_per_seq_s=0.0, prefill_base_s=STEP_S,
                             prefill_per_token_s=0.0)
    engine = Engine(EngineConfig(num_kv_blocks=256, timing_profile=profile),
                    model=TimingModel(model.config, profile), tokenizer=tokenizer)
    step_ends: list[float] = []
    step = engine.step

    def timed_step():  # type: ignore[no-untyped-def]
        result = step()
        if result.num_tokens:
            step_ends.append(time.perf_counter())
        return result

    engine.step = timed_step  # type: ignore[method-assign]
    service = DecodeService(engine, TcpTransport(), "d0", None).start()
    try:
        arrivals: list[float] = []

        async def collect() -> None:
            request = GenerateRequest("r", [1000] * 20, SamplingParams(max_tokens=6, ignore_eos=True))
            async for chunk in service.generate(request):
                arrivals.append(time.perf_counter())
                assert chunk.error is None

        await asyncio.wait_for(collect(), 30)  # the last token held with no step to follow: it never comes
        assert len(arrivals) == len(step_ends) == 6  # a token a step
        lags = [a - e for a, e in zip(arrivals, step_ends, strict=True)]
        assert max(lags) < STEP_S / 2, lags  # held to the next step's end, a lag would be a whole step
    finally:
        service.close()
