"""Admission under load: requests queue instead of failing, the queue's two bounds shed with a reason,
and what a step reports about queueing (wait times, shed requests, preemptions by cause)."""

from __future__ import annotations

import time

import pytest

from workers.engine.request import RequestStatus
from workers.protocol.errors import QueueFullError
from workers.protocol.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def prompt(i: int, n: int = 40) -> list[int]:
    return [1] + list(range(300 + 50 * i, 300 + 50 * i + n - 1))


def run_to_end(engine) -> list:  # type: ignore[no-untyped-def]
    results = []
    while engine.has_unfinished:
        results.append(engine.step())
    return results


def test_a_full_pool_queues_requests_and_serves_them_all(make_engine):
    """Eight requests, room for about two at a time: all finish, in arrival order of admission."""
    engine = make_engine(num_kv_blocks=8)
    ids = [engine.add_request(prompt(i), GREEDY) for i in range(8)]
    results = run_to_end(engine)
    finished = [o.request_id for r in results for o in r.outputs if o.finished]
    assert sorted(finished) == sorted(ids)
    waits = [w for r in results for w in r.queue_seconds]
    assert len(waits) == 8 and max(waits) > min(waits)  # later ones waited for room
    assert engine.block_pool.num_used_blocks == 0 and engine.block_pool.check_integrity()


def test_queue_full_is_refused_at_once_with_its_reason(make_engine):
    engine = make_engine(max_queue_len=2)
    engine.add_request(prompt(0), GREEDY)
    engine.add_request(prompt(1), GREEDY)
    with pytest.raises(QueueFullError, match="2 requests are already waiting") as caught:
        engine.add_request(prompt(2), GREEDY)
    assert caught.value.reason == "queue_full"
    assert len(run_to_end(engine)) > 0 and engine.block_pool.num_used_blocks == 0


def test_a_request_waiting_past_the_time_bound_is_shed_and_holds_nothing(make_engine):
    engine = make_engine(num_kv_blocks=4, max_queue_time_s=0.2)  # one 40-token request at a time
    first = engine.add_request(prompt(0), SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
    engine.step()  # admitted at once
    late = engine.add_request(prompt(1), GREEDY)
    time.sleep(0.3)
    result = engine.step()
    assert [rid for rid, _ in result.shed] == [late] and result.shed[0][1] >= 0.2
    assert late not in engine.scheduler.requests
    finished = [o.request_id for r in run_to_end(engine) for o in r.outputs if o.finished]
    assert finished == [first]  # the admitted request is never shed
    assert engine.block_pool.num_used_blocks == 0 and engine.block_pool.check_integrity()


def test_a_preempted_request_keeps_its_place_past_the_time_bound(make_engine):
    """Preempted requests were admitted once: the queue-time bound never sheds them."""
    engine = make_engine(num_kv_blocks=10, max_queue_time_s=0.05)
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt(i, 30), long) for i in range(3)]  # all three fit at first
    shed, finished = [], []
    while engine.has_unfinished:
        result = engine.step()
        shed += result.shed
        finished += [o.request_id for o in result.outputs if o.finished]
        time.sleep(0.01)  # preempted requests wait far past 0.05 s for their turn again
    assert engine.scheduler.preemptions_by_cause["decode"] > 0
    assert shed == [] and sorted(finished) == sorted(ids)
    assert engine.block_pool.num_used_blocks == 0 and engine.block_pool.check_integrity()


def test_admission_leaves_a_block_of_growth_per_running_request(make_engine):
    engine = make_engine(num_kv_blocks=7)
    a = engine.add_request(prompt(0, 47), GREEDY)  # 3 blocks
    engine.step()
    b = engine.add_request(prompt(1, 47), GREEDY)  # 3 more would leave 1 free: one for a's growth
    c = engine.add_request(prompt(2, 16), GREEDY)  # 1 block: would leave none for two running requests
    engine.step()
    status = {rid: engine.scheduler.requests[rid].status for rid in (a, b, c)}
    assert status == {a: RequestStatus.RUNNING, b: RequestStatus.RUNNING, c: RequestStatus.WAITING}
    run_to_end(engine)
    assert engine.block_pool.num_used_blocks == 0


def test_a_shed_prefill_holds_nothing_for_a_transfer(make_engine):
    """On a prefill worker a finished prompt keeps its blocks for the KV transfer; a shed one has none."""
    engine = make_engine(num_kv_blocks=4, max_queue_time_s=0.2)
    first = engine.add_request(prompt(0), GREEDY, prefill_only=True)
    engine.step()
    late = engine.add_request(prompt(1), GREEDY, prefill_only=True)
    time.sleep(0.3)
    shed = [rid for r in run_to_end(engine) for rid, _ in r.shed]
    assert shed == [late] and list(engine.scheduler.held) == [first]
    assert engine.release_held(first) and engine.block_pool.num_used_blocks == 0
