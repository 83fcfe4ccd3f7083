"""The capacity model's queueing and batching against closed forms, and its answers' direction."""

from __future__ import annotations

import math

import pytest

from cluster.capacity_model import INFEASIBLE, CapacityModel, Load, erlang_c
from router.slo_window import SLOTargets
from tests.cluster.profiles import linear_profile


def test_erlang_c_matches_known_values():
    assert erlang_c(1, 0.7) == pytest.approx(0.7)  # M/M/1: an arrival waits with probability rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)
    assert erlang_c(10, 5.0) == pytest.approx(0.0361, abs=1e-4)  # tables: c=10, a=5


def test_the_wait_quantile_is_mm1s_closed_form():
    model = CapacityModel(linear_profile(), SLOTargets(2.0, 0.1), attainment=0.9)
    rate, service = 4.0, 0.2  # rho 0.8, mu 5
    expected = math.log(0.8 / 0.1) / (5.0 - 4.0)
    assert model._wait_quantile(rate, service, 1) == pytest.approx(expected)
    assert model._wait_quantile(rate, service, 4) == 0.0  # rarely anyone waits: within the 10% allowed
    assert model._wait_quantile(5.0, service, 1) == INFEASIBLE


def test_profile_grids_reproduce_the_formula_between_points():
    profile = linear_profile()
    assert profile.decode_step_s(20, 300) == pytest.approx(0.02 + 0.004 * 20 + 1e-6 * 20 * 300)
    assert profile.prefill_s(500, 100) == pytest.approx(0.01 + 2e-4 * (500 + 25))
    assert profile.decode_step_s(0, 100) == 0.0


def test_the_decode_batch_is_littles_law_at_its_own_step_time():
    profile = linear_profile()
    model = CapacityModel(profile, SLOTargets(2.0, 0.1))
    load = Load(rate=4.0, prompt_tokens=200, output_tokens=101)
    batch = model.decode_batch(load, decode_workers=2)
    step = profile.decode_step_s(math.ceil(batch), 200 + 101 / 2)
    assert batch == pytest.approx(4.0 / 2 * 100 * step, rel=1e-3)
    assert model.decode_batch(Load(50.0, 200, 101), decode_workers=1) == INFEASIBLE  # past max_num_seqs


def test_more_workers_never_predict_worse_and_an_overload_is_infeasible():
    model = CapacityModel(linear_profile(), SLOTargets(2.0, 0.1))
    load = Load(rate=6.0, prompt_tokens=800, output_tokens=64)
    ttfts = [model.ttft_s(load, p, 4) for p in range(1, 6)]
    tpots = [model.tpot_s(load, 2, d) for d in range(1, 6)]
    assert ttfts == sorted(ttfts, reverse=True) and tpots == sorted(tpots, reverse=True)
    assert model.ttft_s(Load(1000.0, 800, 64), 1, 4) == INFEASIBLE
    # Without prefill workers the decode workers run the prompts, and their tokens slow down for it.
    assert model.tpot_s(load, 0, 4) > model.tpot_s(load, 1, 4)
