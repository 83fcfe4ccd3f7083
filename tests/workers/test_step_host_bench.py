"""bench_step_host runs: its steps are timed decode-only launched steps of the whole batch (it broke once
when requests admitted early finished while the steps were timed)."""

from __future__ import annotations

from tests.bench.bench_step_host import measure
from workers.model.open_model import open_model
from workers.model.tokenizer import Tokenizer


def test_bench_step_host_times_full_batches():
    tokenizer = Tokenizer.load(open_model(None).source)
    figures = measure(tokenizer, batch=64, steps=20)  # asserts every timed step holds all 64
    assert figures["step_ms"] > 0 and figures["stage_ms"] > 0 and figures["schedule_ms"] > 0
