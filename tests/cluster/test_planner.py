"""``tandem plan``: the cluster simulation against hand-worked cases, the search's direction, the CLI."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main
from cluster.cluster_sim import SimSpec, simulate
from cluster.config import load_config
from cluster.planner import find_plan
from router.slo_window import SLOTargets
from tests.cluster.profiles import linear_profile


def test_an_unloaded_request_takes_its_prefill_transfer_and_decode_steps():
    profile = linear_profile()
    spec = SimSpec(rate=0.01, input_len=300, output_len=5, num_requests=3)  # 100 s apart: nobody waits
    remote = simulate(profile, spec, prefill=1, decode=1)
    local = simulate(profile, spec, prefill=0, decode=1)
    for r in remote.requests:
        assert r.first_token - r.arrival == pytest.approx(profile.prefill_s(300, 0) + profile.transfer_tokens_s(300))
        assert r.tokens == 5 and (r.last_token - r.first_token) == pytest.approx(
            sum(profile.decode_step_s(1, 300 + k) for k in range(1, 5)))
    for r in local.requests:
        assert r.first_token - r.arrival == pytest.approx(profile.prefill_s(300, 0))


def test_a_worker_past_its_capacity_misses_and_a_second_one_recovers():
    profile = linear_profile(prefill_base_s=0.1, prefill_per_token_s=0.0)  # 0.1 s a prompt
    slo = SLOTargets(ttft_s=1.0, tpot_s=1.0)
    spec = SimSpec(rate=12.0, input_len=100, output_len=2, num_requests=400)
    # One prefill worker batches queued prompts into one step, but each costs its 0.1 s: 12/s is 1.2x its capacity.
    assert simulate(profile, spec, 1, 2).attainment(slo) < 0.5
    assert simulate(profile, spec, 2, 2).attainment(slo) > 0.9


def test_a_prompt_heavy_load_gets_more_prefill_per_decode_than_an_output_heavy_one():
    profile = linear_profile(prefill_base_s=0.01, prefill_per_token_s=2e-4, decode_per_seq_s=0.002)
    slo = SLOTargets(ttft_s=1.0, tpot_s=0.05)
    prompt_heavy = find_plan(profile, SimSpec(4.0, 2000, 16), slo)
    output_heavy = find_plan(profile, SimSpec(4.0, 100, 400), slo)
    assert prompt_heavy is not None and output_heavy is not None
    assert prompt_heavy.prefill / prompt_heavy.decode > output_heavy.prefill / output_heavy.decode
    assert prompt_heavy.attainment >= 0.9 and output_heavy.attainment >= 0.9


def test_plan_prints_json_and_writes_a_cluster_yaml_serve_accepts(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    linear_profile().save(profile)
    out = tmp_path / "cluster.yaml"
    args = ["plan", "--profile", str(profile), "--rate", "2", "--input-len", "300", "--output-len", "32",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--num-requests", "200", "--json", "--out", str(out)]
    assert main(args) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["predicted_attainment"] >= 0.9 and plan["decode"] >= 1
    assert plan["concurrent_requests_per_worker"] == min(64, 65536 // 332)
    config = load_config(out)
    assert (config.prefill.replicas, config.decode.replicas) == (plan["prefill"], plan["decode"])
    assert config.autoscaler.enabled and config.slo.ttft_ms == 1000
    assert main([*args[:2], str(tmp_path / "missing.json"), *args[3:]]) == 2
