"""Routing policies are pure functions; each rule checked on small hand-made views."""

from __future__ import annotations

import pytest

from router.policy import (
    PolicyConfig,
    RoundRobin,
    WorkerView,
    choose_decode_worker,
    choose_least_loaded,
    choose_prefill_worker,
    prefill_cost,
    should_prefill_locally,
)

BS = 16
CFG = PolicyConfig()


def view(w: str, running: int = 0, waiting: int = 0, queued: int = 0, free: int = 100) -> WorkerView:
    return WorkerView(w, running, waiting, queued, free)


def test_prefill_prefers_the_longest_cached_prefix():
    views = [view("p0"), view("p1")]
    assert choose_prefill_worker(views, {"p1": 50}, 64, BS, CFG, tie_key=0) == "p1"


def test_cached_prefix_is_weighed_against_queued_work_and_load():
    pure = PolicyConfig(prefix_affinity=0.0)  # the bare cost, no margin for the cached prefix
    # p1 holds 50 of 64 blocks but has 60 blocks of queued prefill: p0 computes 64, p1 14 + 60.
    views = [view("p0"), view("p1", queued=60 * BS)]
    assert choose_prefill_worker(views, {"p1": 50}, 64, BS, pure, tie_key=0) == "p0"
    assert prefill_cost(views[1], 64, 50, BS, pure) == pytest.approx(74.0)
    busy = [view("p0"), view("p1", running=20)]
    assert choose_prefill_worker(busy, {"p1": 10}, 64, BS, pure, tie_key=0) == "p0"
    light = PolicyConfig(load_weight=0.1, prefix_affinity=0.0)
    assert choose_prefill_worker(busy, {"p1": 10}, 64, BS, light, tie_key=0) == "p1"


def test_close_costs_stay_with_the_cached_prefix():
    # p1 holds 60 of 64 blocks but has 62 blocks queued: 66 against p0's 64, within the margin (16).
    views = [view("p0"), view("p1", queued=62 * BS)]
    assert choose_prefill_worker(views, {"p1": 60}, 64, BS, CFG, tie_key=0) == "p1"
    strict = PolicyConfig(prefix_affinity=0.0)
    assert choose_prefill_worker(views, {"p1": 60}, 64, BS, strict, tie_key=0) == "p0"
    swamped = [view("p0"), view("p1", queued=100 * BS)]  # clearly slower: the request moves
    assert choose_prefill_worker(swamped, {"p1": 60}, 64, BS, CFG, tie_key=0) == "p0"


def test_ties_break_by_key_the_same_everywhere():
    views = [view(f"p{i}") for i in range(4)]
    picks = {choose_prefill_worker(views, {}, 8, BS, CFG, tie_key=k) for k in range(16)}
    assert picks == {"p0", "p1", "p2", "p3"}  # spread over prefixes ...
    again = [choose_prefill_worker(list(reversed(views)), {}, 8, BS, CFG, tie_key=5) for _ in range(3)]
    assert again == [choose_prefill_worker(views, {}, 8, BS, CFG, tie_key=5)] * 3  # ... yet deterministic


def test_new_prefixes_spread_over_the_caches():
    views = [view("p0")._replace(cached_blocks=300), view("p1")._replace(cached_blocks=60)]
    assert {choose_prefill_worker(views, {}, 64, BS, CFG, tie_key=k) for k in range(8)} == {"p1"}


def test_decode_worker_by_wait_then_batch_then_room():
    views = [view("d0", free=10), view("d1", free=40), view("d2", free=25)]
    assert choose_decode_worker(views, 20, tie_key=0) == "d1"  # d0 has no room for 20 blocks: it would queue
    assert choose_decode_worker(views, 5, tie_key=0) == "d1"  # all fit: the most room
    # Pools of different sizes (a worker started later takes a share of what memory was left): the
    # smaller batch wins, not the bigger pool.
    assert choose_decode_worker([view("d0", running=3, free=2000), view("d1", free=1000)], 4, tie_key=0) == "d1"
    # d1's 30 running requests each take a block soon: its 40 free blocks leave no room for 12 more.
    assert choose_decode_worker([view("d1", running=30, free=40), view("d2", running=31, free=90)], 12,
                                tie_key=0) == "d2"
    # A full pool is never refused: the request goes where the fewest wait ahead of it.
    assert choose_decode_worker([view("d0", waiting=2, free=90), view("d1", free=0)], 1, tie_key=0) == "d1"
    assert choose_decode_worker([view("d0", waiting=3), view("d1", waiting=1, free=0)], 1, tie_key=0) == "d1"


def test_local_prefill_when_little_is_left_or_most_is_cached():
    assert should_prefill_locally(40, 0, CFG)  # short prompt: moving KV costs more
    assert not should_prefill_locally(1000, 0, CFG)
    assert should_prefill_locally(1000, 960, CFG)  # multi-turn: the decode worker holds the prefix
    assert should_prefill_locally(1000, 800, CFG)
    assert not should_prefill_locally(1000, 500, CFG)


def test_baselines():
    views = [view("a", running=3), view("b", running=1, queued=5), view("c", running=1)]
    assert choose_least_loaded(views, tie_key=0) == "c"
    rr = RoundRobin()
    assert [rr.choose(views) for _ in range(4)] == ["a", "b", "c", "a"]


def test_bad_policy_config_is_refused():
    with pytest.raises(ValueError, match="policy"):
        PolicyConfig(policy="random")
    with pytest.raises(ValueError, match="weights"):
        PolicyConfig(prefill_weight=-1)
    with pytest.raises(ValueError, match="decode_affinity_slack"):
        PolicyConfig(decode_affinity_slack=-1)


@pytest.mark.parametrize("policy", ["least_loaded", "round_robin"])
def test_prefix_aware_knobs_are_refused_under_the_policies_that_do_not_read_them(policy):
    with pytest.raises(ValueError, match=rf"^prefix_affinity, decode_affinity_slack: only the prefix_aware policy "
                                         rf"reads this, and the policy is {policy}"):
        PolicyConfig(policy, prefix_affinity=0.5, decode_affinity_slack=0)
    assert PolicyConfig(policy).unread_knobs() == []  # the defaults: nothing set, nothing refused
    assert PolicyConfig(prefix_affinity=0.5, decode_affinity_slack=0).unread_knobs() == []


def test_a_decode_worker_caching_the_prompt_keeps_it_within_the_slack():
    # d1 holds 60 of the prompt's 64 blocks (a conversation's earlier turns) and runs 3 more requests than d0:
    # within 4 x 60/64 = 3.75, so it keeps the request; 4 more is past it.
    views = [view("d0", running=1), view("d1", running=4)]
    assert choose_decode_worker(views, 64, 0, {"d1": 60}, slack=4) == "d1"
    assert choose_decode_worker([view("d0", running=1), view("d1", running=5)], 64, 0, {"d1": 60}, slack=4) == "d0"
    assert choose_decode_worker(views, 64, 0, {"d1": 60}, slack=0) == "d0"  # no slack: load alone
    # A few blocks cached (a shared system prompt) buy little: 4 x 4/64 = 0.25 of a request.
    assert choose_decode_worker([view("d0"), view("d1", running=1)], 64, 0, {"d1": 4}, slack=4) == "d0"
    assert choose_decode_worker([view("d0", free=90), view("d1", free=20)], 8, 0, {"d1": 4}, slack=4) == "d1"
    # Never at the price of queueing: d1 has no room for the prompt's blocks.
    assert choose_decode_worker([view("d0"), view("d1", free=30)], 64, 0, {"d1": 60}, slack=4) == "d0"
    # The longest cached prefix among those within the slack.
    three = [view("d0"), view("d1", running=1), view("d2", running=2)]
    assert choose_decode_worker(three, 64, 0, {"d1": 40, "d2": 64}, slack=4) == "d2"


def test_prompt_cache_key_orders_the_workers_the_same_everywhere():
    decoders = [view(f"d{i}") for i in range(4)]
    homes = {key: choose_decode_worker(decoders, 8, 0, cache_key=key) for key in map(str, range(40))}
    assert set(homes.values()) == {"d0", "d1", "d2", "d3"}  # keys spread over the workers ...
    for key, home in homes.items():  # ... each to one, whatever the tie key and the views' order
        assert {choose_decode_worker(list(reversed(decoders)), 8, k, cache_key=key) for k in range(4)} == {home}
    # Rendezvous: a worker leaving moves only its own keys.
    without_d3 = [v for v in decoders if v.worker_id != "d3"]
    moved = {k for k, home in homes.items() if choose_decode_worker(without_d3, 8, 0, cache_key=k) != home}
    assert moved == {k for k, home in homes.items() if home == "d3"}
    # The key chooses among the workers within the slack of the least busy: a home busier than that is passed over.
    key = next(k for k, home in homes.items() if home == "d2")
    busy = [view("d0"), view("d1"), view("d2", running=2), view("d3")]
    assert choose_decode_worker(busy, 8, 0, slack=2, cache_key=key) == "d2"
    assert choose_decode_worker(busy, 8, 0, slack=1, cache_key=key) != "d2"
    # A worker caching the prompt comes before the key's home.
    assert choose_decode_worker(decoders, 8, 0, {"d1": 6}, slack=4, cache_key=key) == "d1"
    # Prefill: the key decides a tie (before spreading over the caches), never against a cached prefix.
    prefillers = [view("p0")._replace(cached_blocks=300), view("p1")._replace(cached_blocks=60)]
    picks = {choose_prefill_worker(prefillers, {}, 64, BS, CFG, tie_key=0, cache_key=str(k)) for k in range(20)}
    assert picks == {"p0", "p1"}
    assert {choose_prefill_worker(prefillers, {"p0": 50}, 64, BS, CFG, tie_key=0, cache_key=str(k))
            for k in range(20)} == {"p0"}
