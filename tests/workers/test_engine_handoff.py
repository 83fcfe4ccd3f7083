"""Engine hooks for disaggregation: a prefill engine hands KV + first token to a decode engine.

The KV is copied tensor to tensor here (transports have their own tests), so any difference from a
single engine's output is the hooks' fault.
"""

from __future__ import annotations

import pytest

from tests.prompts import text_of_tokens
from workers.engine.engine import Engine
from workers.engine.request import RequestStatus
from workers.protocol.sampling_params import SamplingParams


def handoff(prefill: Engine, decode: Engine, prompt, params: SamplingParams, rid: str) -> tuple[list[int], str]:
    """Run one request through prefill -> decode; returns (token ids, text)."""
    decode.add_request(prompt, params, request_id=rid, remote_prefill=True)
    (reservation,) = decode.step().reservations
    prefill.add_request(prompt, params, request_id=rid, prefill_only=True)
    outs = []
    while prefill.has_unfinished:
        outs += prefill.step().outputs
    (first,) = outs
    assert first.finished and len(first.new_token_ids) == 1
    src = prefill.held_block_ids(rid)
    skip = reservation.num_cached_tokens // decode.block_pool.block_size
    for s, d in zip(src[skip:], reservation.block_ids[skip:], strict=True):
        decode.runner.kv_cache[:, :, d] = prefill.runner.kv_cache[:, :, s]
    assert prefill.release_held(rid)
    out = decode.commit_remote_kv(rid, first.new_token_ids[0], first.new_logprobs[0] if first.new_logprobs else None)
    assert out is not None
    tokens, text = list(out.new_token_ids), out.new_text
    while not out.finished:
        (out,) = [o for o in decode.step().outputs if o.request_id == rid]
        tokens += out.new_token_ids
        text += out.new_text
    return tokens, text


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=12, temperature=0.0),
                                    SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)],
                         ids=["greedy", "seeded"])
def test_handoff_matches_single_engine(make_engine, params):
    prefill, decode, single = make_engine(), make_engine(), make_engine()
    prompt = text_of_tokens(single.tokenizer, 70, seed=2)
    (expected,) = single.generate([prompt], params)
    tokens, text = handoff(prefill, decode, prompt, params, "r1")
    assert tokens == expected.token_ids
    assert text == expected.text
    for engine in (prefill, decode):
        assert engine.block_pool.num_used_blocks == 0  # only evictable cache remains
        engine.block_pool.check_integrity()


def test_decode_worker_caches_received_blocks_and_skips_them_next_turn(make_engine):
    prefill, decode = make_engine(), make_engine()
    prompt = text_of_tokens(decode.tokenizer, 70, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    handoff(prefill, decode, prompt, params, "turn1")
    decode.add_request(prompt + " and more", params, request_id="turn2", remote_prefill=True)
    (reservation,) = decode.step().reservations
    assert reservation.num_cached_tokens == 64  # 4 full blocks of the first turn, served locally


def test_reserved_blocks_wait_outside_the_batch_and_abort_frees_them(make_engine):
    decode = make_engine(num_kv_blocks=8)
    decode.add_request("x " * 100, SamplingParams(max_tokens=4), request_id="a", remote_prefill=True)
    decode.add_request("y " * 100, SamplingParams(max_tokens=4), request_id="b", remote_prefill=True)
    reserved = decode.step().reservations
    assert [r.request_id for r in reserved] == ["a"]  # b waits: no home for its KV yet
    assert decode.scheduler.requests["a"].status is RequestStatus.WAITING_FOR_KV
    assert decode.abort("a")
    assert [r.request_id for r in decode.step().reservations] == ["b"]
    decode.abort("b")
    assert decode.block_pool.num_used_blocks == 0


def test_prefill_only_holds_blocks_until_released_or_aborted(make_engine):
    prefill = make_engine()
    prefill.add_request("hello " * 40, SamplingParams(max_tokens=50, temperature=0.0), request_id="p",
                        prefill_only=True)
    outs = []
    while prefill.has_unfinished:
        outs += prefill.step().outputs
    assert len(outs) == 1 and outs[0].finished
    held = prefill.held_block_ids("p")
    assert prefill.block_pool.num_used_blocks == len(held) > 0
    assert prefill.abort("p")  # a cancel after the prefill lets the blocks go
    assert prefill.block_pool.num_used_blocks == 0
    assert not prefill.release_held("p")


def test_commit_after_abort_is_ignored(make_engine):
    decode = make_engine()
    decode.add_request("hello there", SamplingParams(max_tokens=4), request_id="a", remote_prefill=True)
    decode.step()
    decode.abort("a")
    assert decode.commit_remote_kv("a", 5, None) is None
    assert decode.block_pool.num_used_blocks == 0


def test_a_prefix_being_computed_is_waited_for_not_computed_twice(make_engine):
    """Two requests sharing a long prefix arrive together: the second waits for the first's blocks."""
    engine = make_engine(prefill_chunk_size=64, block_size=16)
    shared = list(range(100, 420))  # 320 tokens: 5 chunks of prefill
    prompts = [shared + [7, 8, 9], shared + [10, 11]]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    cached: dict[str, int] = {}
    while engine.has_unfinished:
        for out in engine.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert cached == {ids[0]: 0, ids[1]: 320}  # every full block of the shared prefix reused
    assert engine.stats().prefix_hit_tokens_total == 320
    want = make_engine().generate(prompts, params)
    assert [tokens[rid] for rid in ids] == [w.token_ids for w in want]
