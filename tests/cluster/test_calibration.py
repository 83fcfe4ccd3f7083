"""``tandem plan --calibrate``: the prompt and decode time scales fitted to a measured run (a loadgen report)
are the ones the run was made with, and the plan predicts with them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.calibration import CalibrationError, MeasuredRun, fit_scales, load_run, simulated_medians
from cluster.cli import main
from cluster.cluster_sim import SimSpec, simulate
from loadgen.metrics import RequestRecord
from tests.cluster.profiles import linear_profile

PROMPT_SCALE, DECODE_SCALE = 1.3, 2.0


def _measured_report(tmp_path: Path) -> Path:
    """A loadgen report of a cluster (0 prefill + 1 decode, under its capacity: an overloaded run
    fits many scales) whose steps take the profile's time scaled by
    PROMPT_SCALE and DECODE_SCALE: the simulation's requests written as loadgen writes its records."""
    spec = SimSpec(rate=1.0, input_len=300, output_len=32, num_requests=120, input_jitter=0.5, seed=5,
                   prefill_scale=PROMPT_SCALE, decode_scale=DECODE_SCALE)
    records = []
    for i, r in enumerate(simulate(linear_profile(), spec, 0, 1).requests):
        step = (r.last_token - r.first_token) / (r.tokens - 1)
        records.append(RequestRecord(i, r.arrival, r.arrival, [r.first_token + k * step for k in range(r.tokens)],
                                     r.prompt, r.tokens, 200, None, r.last_token))
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"config": {}, "summary": {}, "requests": [r.to_json(2000, 100) for r in records]}))
    return path


def test_the_fit_finds_the_scales_the_run_was_made_with(tmp_path):
    run = load_run(_measured_report(tmp_path))
    assert len(run.trace) == 120
    prompt_scale, decode_scale = fit_scales(linear_profile(), run, prefill=0, decode=1)
    assert prompt_scale == pytest.approx(PROMPT_SCALE, rel=0.05)
    assert decode_scale == pytest.approx(DECODE_SCALE, rel=0.05)
    ttft, tpot = simulated_medians(linear_profile(), run, 0, 1, prompt_scale, decode_scale)
    assert ttft == pytest.approx(run.ttft_p50_s, rel=0.02) and tpot == pytest.approx(run.tpot_p50_s, rel=0.02)


def test_the_unscaled_profile_misses_the_run_the_fit_matches(tmp_path):
    run = load_run(_measured_report(tmp_path))
    ttft, tpot = simulated_medians(linear_profile(), run, 0, 1, 1.0, 1.0)
    assert tpot < 0.7 * run.tpot_p50_s and ttft < 0.9 * run.ttft_p50_s


def test_a_measurement_beyond_the_bounds_stops_at_a_bound():
    run = MeasuredRun([(0.0, 100, 8)] * 1, ttft_p50_s=1e6, tpot_p50_s=1e6)
    assert fit_scales(linear_profile(), run, 0, 1) == pytest.approx((8.0, 8.0), rel=0.01)


def test_plan_predicts_with_the_fitted_corrections(tmp_path, capsys):
    report = _measured_report(tmp_path)
    profile = tmp_path / "profile.json"
    linear_profile().save(profile)
    common = ["plan", "--profile", str(profile), "--rate", "1", "--input-len", "300", "--input-jitter", "0.5",
              "--output-len", "32", "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--num-requests", "200",
              "--prefill", "0", "--decode", "1", "--json"]
    assert main([*common, "--calibrate", str(report)]) == 0
    calibrated = json.loads(capsys.readouterr().out)
    assert calibrated["corrections"] == pytest.approx([PROMPT_SCALE, DECODE_SCALE], rel=0.05)
    assert main([*common, "--corrections", ",".join(str(c) for c in calibrated["corrections"])]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_goodput_rps"] == calibrated["predicted_goodput_rps"]
    assert main(common) == 0
    assert json.loads(capsys.readouterr().out)["corrections"] == [1.0, 1.0]


@pytest.mark.parametrize("extra, says", [
    (["--corrections", "1,1"], "not both"),
    (["--calibrate-split", "1"], "PREFILL,DECODE"),
    (["--calibrate-split", "0,0"], "at least one decode"),
    ([], "needs --calibrate-split"),
])
def test_bad_calibration_arguments_are_refused(tmp_path, capsys, extra, says):
    profile = tmp_path / "profile.json"
    linear_profile().save(profile)
    args = ["plan", "--profile", str(profile), "--rate", "1", "--input-len", "100", "--output-len", "8",
            "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--calibrate", str(_measured_report(tmp_path)), *extra]
    assert main(args) == 2
    assert says in capsys.readouterr().err


def test_a_split_without_a_run_to_calibrate_on_is_refused(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    linear_profile().save(profile)
    assert main(["plan", "--profile", str(profile), "--rate", "1", "--input-len", "100", "--output-len", "8",
                 "--slo-ttft-ms", "1000", "--slo-tpot-ms", "100", "--calibrate-split", "0,1"]) == 2
    assert "give --calibrate too" in capsys.readouterr().err


def test_a_file_that_is_not_a_report_is_refused(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"summary": {}}')
    with pytest.raises(CalibrationError, match="not a tandem loadgen report"):
        load_run(bad)
    bad.write_text(json.dumps({"requests": []}))
    with pytest.raises(CalibrationError, match="at least 5"):
        load_run(bad)
