"""``tandem soak``'s cancel plan. The soak itself runs against a whole cluster in
tests/cluster/test_worker_loss.py."""

from __future__ import annotations

from loadgen.soak import CancelPoint, plan_cancels
from loadgen.tokens import TokenText, WordTokenizer
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload


def test_cancel_plans_are_seeded_and_cover_both_points():
    spec = WorkloadSpec(num_requests=300, input_len=LengthSpec("fixed", 20), output_len=LengthSpec("fixed", 16),
                        rate=1.0)
    workload = build_workload(spec, TokenText(WordTokenizer()))
    plan = plan_cancels(workload, 0.2, seed=3)
    assert plan == plan_cancels(workload, 0.2, seed=3) and plan != plan_cancels(workload, 0.2, seed=4)
    chosen = [c for c in plan if c is not None]
    assert 40 <= len(chosen) <= 80  # 20% of 300, give or take the draw
    assert {c.kind for c in chosen} == {"before_first_token", "mid_stream"}
    assert all(1 <= c.after_tokens <= 15 for c in chosen if c.kind == "mid_stream")
    assert CancelPoint(0, 0.3).kind == "before_first_token"
