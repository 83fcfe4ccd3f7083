"""Preemption under a small pool, abort, and the pool left clean afterwards (default model)."""

from __future__ import annotations

from workers.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


def prompts():
    return [[1] + list(range(200 + 37 * i, 200 + 37 * i + 20 + 9 * i)) for i in range(6)]


def test_preemption_recomputes_to_identical_outputs(make_engine):
    roomy = make_engine(num_kv_blocks=512).generate(prompts(), GREEDY)
    tight = make_engine(num_kv_blocks=24)  # room for ~4 of the 6 requests at full length
    results = tight.generate(prompts(), GREEDY)
    assert sum(tight.scheduler.preemptions_by_cause.values()) > 0
    assert [r.token_ids for r in results] == [r.token_ids for r in roomy]
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
