"""``tandem profile``'s decode measurement: every request of a timed step reads its own KV, as on a decode
worker (a shared prompt would be read from the CPU's caches and time a large batch's attention at a fraction of
what serving it costs), and a batch whose KV cannot fit is extrapolated, not run."""

from __future__ import annotations

import pytest

from cluster import profiler


@pytest.fixture
def small_grid(monkeypatch):
    monkeypatch.setattr(profiler, "DECODE_BATCH", (1, 2, 4, 8))
    monkeypatch.setattr(profiler, "DECODE_CONTEXT", (32, 64))
    monkeypatch.setattr(profiler, "REPEATS", 1)


def test_each_timed_request_reads_its_own_blocks_and_a_batch_too_big_is_extrapolated(make_engine, small_grid):
    engine = make_engine(num_kv_blocks=30)  # context 64: 5 blocks a request, so 4 requests + the source fit
    used_in_timed_steps: list[tuple[int, int]] = []
    step = engine.step

    def recording_step():
        result = step()
        if result.is_decode_only and result.num_tokens:  # a timed step (not the one reserving blocks)
            used_in_timed_steps.append((len(result.outputs), engine.block_pool.num_used_blocks))
        return result

    engine.step = recording_step
    grid = profiler._measure_decode(engine, engine.model.config.vocab_size, say=lambda _: None)

    for batch, used in used_in_timed_steps:  # the batch's own blocks, beside the held source prompt's
        assert used >= (batch + 1) * 2, (batch, used)  # at least 2 blocks each at context 32
    assert {b for b, _ in used_in_timed_steps} == {1, 2, 4, 8}  # batch 8 ran at context 32 ...
    assert not profiler._fits(engine, 8, 64) and profiler._fits(engine, 4, 64)  # ... and not at context 64
    at_64 = [row[1] for row in grid.zs]
    assert at_64[3] == pytest.approx(at_64[2] + max(at_64[2] - at_64[1], 0) / 2 * 4)  # on the line from 2 and 4
    assert all(z > 0 for row in grid.zs for z in row)
    assert engine.block_pool.num_used_blocks == 0  # nothing held after the measurement
