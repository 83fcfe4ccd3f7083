"""Preemption under a small pool, abort, and the pool left clean afterwards (default model)."""

from __future__ import annotations

from tests.workers.test_engine_vs_hf import full_prefill_logits
from workers.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts():
    return [[1] + list(range(200 + 37 * i, 200 + 37 * i + 20 + 9 * i)) for i in range(6)]


def test_preemption_recomputes_to_identical_outputs(make_engine):
    """A preempted request's recompute prefills its tokens with other kernels (prefill attention, other
    tiles) than the decode steps that made them: the same numbers summed in another order. Its text must
    match the undisturbed run's up to a near-tie of the top two logits, and only at one."""
    roomy_engine = make_engine(num_kv_blocks=512)
    roomy = roomy_engine.generate(prompts(), GREEDY)
    tight = make_engine(num_kv_blocks=24)  # room for ~4 of the 6 requests at full length
    results = tight.generate(prompts(), GREEDY)
    assert sum(tight.scheduler.preemptions_by_cause.values()) > 0
    forks = 0
    for prompt, want, got in zip(prompts(), roomy, results, strict=True):
        fork = next((i for i, (a, b) in enumerate(zip(want.token_ids, got.token_ids, strict=True)) if a != b),
                    None)
        if fork is None:
            assert got.token_ids == want.token_ids
            continue
        forks += 1
        logits = full_prefill_logits(roomy_engine.model, prompt + want.token_ids[:fork])[-1]
        top2 = logits.topk(2)
        assert set(top2.indices.tolist()) == {want.token_ids[fork], got.token_ids[fork]}
        assert (top2.values[0] - top2.values[1]).item() < 0.1, f"fork at token {fork} is no tie: {top2}"
    assert forks <= 1
    assert tight.block_pool.num_used_blocks == 0 and tight.block_pool.check_integrity()


def test_abort_mid_decode_frees_blocks(make_engine):
    engine = make_engine()
    keep = engine.add_request(prompts()[0], GREEDY)
    drop = engine.add_request(prompts()[1], GREEDY)
    for _ in range(5):
        engine.step()
    used_before = engine.block_pool.num_used_blocks
    assert engine.abort(drop)
    assert engine.block_pool.num_used_blocks < used_before
    assert not engine.abort(drop)  # already gone
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step().outputs
    assert {o.request_id for o in outputs} == {keep}
    assert engine.block_pool.num_used_blocks == 0


def test_max_num_seqs_caps_the_running_batch(make_engine):
    engine = make_engine(max_num_seqs=2)
    for p in prompts():
        engine.add_request(p, SamplingParams(max_tokens=3, temperature=0))
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 2
