"""loadgen against a live (fake) server: reports, recomputable percentiles, errors, interruption."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from loadgen.cli import main
from tests.loadgen.fake_server import GAP_S, TTFT_S, free_port, running_server

COMMON = ["--input-len", "uniform:5:20", "--output-len", "uniform:4:12", "--no-progress", "--seed", "3",
          "--tokenizer", "words"]  # token-exact text is tested in test_workload


@pytest.fixture(scope="module")
def server_url():
    with running_server() as url:
        yield url


def load(out):
    return json.loads((out / "report.json").read_text())


def test_run_writes_reports_and_percentiles_recompute(server_url, tmp_path):
    out = tmp_path / "run"
    assert main(["--url", server_url, "--rate", "20", "--num-requests", "30", "--out", str(out),
                 "--slo-ttft-ms", "500", "--slo-tpot-ms", "100", *COMMON]) == 0
    for name in ("report.json", "report.md", "ttft_cdf.png", "tpot_cdf.png", "latency_over_time.png"):
        assert (out / name).stat().st_size > 500, name
    doc = load(out)
    assert doc["config"]["model"] == "fake"  # read from /v1/models
    s, reqs = doc["summary"], doc["requests"]
    assert s["num_requests"] == 30 and s["num_ok"] == 30
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        values = [r[key] for r in reqs if r[key] is not None]
        for p in (50, 90, 99):
            assert s[key][f"p{p}"] == pytest.approx(float(np.percentile(values, p)))
    # the fake server's timings come back out of the measurements
    assert s["ttft_ms"]["p50"] >= TTFT_S * 1e3 and s["tpot_ms"]["p50"] >= GAP_S * 1e3
    assert s["slo_attainment"] == 1.0 and all(r["output_tokens"] == len(r["token_times_s"]) for r in reqs)


def test_closed_loop_multi_turn_shared_prefix(server_url, tmp_path):
    out = tmp_path / "conv"
    assert main(["--url", server_url, "--concurrency", "3", "--num-requests", "4", "--turns", "3",
                 "--prefix-groups", "2", "--prefix-len", "8", "--api", "completions", "--out", str(out),
                 *COMMON]) == 0
    assert load(out)["summary"]["num_ok"] == 12  # 4 conversations x 3 turns


def test_sampling_knobs_go_out_in_every_request_and_into_the_report(server_url, tmp_path):
    out = tmp_path / "sampled"
    assert main(["--url", server_url, "--rate", "20", "--num-requests", "3", "--temperature", "0.7", "--top-p", "0.9",
                 "--out", str(out), *COMMON]) == 0
    assert load(out)["config"]["sampling"] == {"temperature": 0.7, "top_p": 0.9}
    assert "- sampling: temperature 0.7, top_p 0.9" in (out / "report.md").read_text()
    greedy = tmp_path / "greedy"
    assert main(["--url", server_url, "--rate", "20", "--num-requests", "1", "--out", str(greedy), *COMMON]) == 0
    assert "- sampling: greedy (temperature 0)" in (greedy / "report.md").read_text()
    for bad in (["--top-p", "0"], ["--temperature", "3"]):  # refused before a request goes out
        assert main(["--url", "http://127.0.0.1:9", *bad, "--out", str(tmp_path / "bad"), *COMMON]) == 2
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("model, kind", [("bad", "http 400"), ("boom", "http 500"), ("slow", "timeout")])
def test_server_errors_are_counted(server_url, tmp_path, model, kind):
    out = tmp_path / model
    assert main(["--url", server_url, "--model", model, "--rate", "50", "--num-requests", "3", "--timeout", "0.5",
                 "--out", str(out), *COMMON]) == 0
    s = load(out)["summary"]
    assert s["num_errors"] == 3 and s["errors_by_kind"] == {kind: 3} and s["slo_attainment"] == 0


def test_connection_refused_is_counted(tmp_path):
    out = tmp_path / "refused"
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--url", url, "--model", "x", "--rate", "50", "--num-requests", "2", "--out", str(out),
                 *COMMON]) == 0
    assert load(out)["summary"]["errors_by_kind"] == {"connect": 2}


def test_sweep_and_compare(server_url, tmp_path):
    out = tmp_path / "sweep"
    assert main(["--url", server_url, "--sweep-rates", "10,40", "--num-requests", "10", "--out", str(out),
                 "--slo-ttft-ms", "1000", *COMMON]) == 0
    doc = load(out)
    assert [p["rate"] for p in doc["sweep"]] == [10, 40] and doc["capacity_rps"] == 40
    assert [load(out / f"rate_{r}")["config"]["seed"] for r in (10, 40)] == [3, 4]  # new prompts at each point
    assert (out / "goodput_vs_rate.png").stat().st_size > 500
    assert main(["compare", str(out / "rate_10"), str(out / "rate_40"), str(out), "--out", str(tmp_path / "cmp")]) == 0
    assert {p.name for p in (tmp_path / "cmp").iterdir()} == {"ttft_cdf.png", "tpot_cdf.png", "goodput_vs_rate.png"}


def test_ctrl_c_still_writes_the_report(server_url, tmp_path):
    out = tmp_path / "interrupted"
    proc = subprocess.Popen([sys.executable, "-m", "loadgen", "--url", server_url, "--rate", "4",
                             "--num-requests", "200", "--out", str(out), *COMMON],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    while "running" not in proc.stderr.readline():  # set-up done, requests going out
        assert proc.poll() is None
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    try:  # generous: in a full suite on 2 busy cores the report's plots have taken over 30 s to write
        _, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
        pytest.fail(f"loadgen still ran 90 s after SIGINT; its stderr:\n{err[-4000:]}")
    assert proc.returncode == 0, err
    doc = load(out)
    assert doc["config"]["interrupted"] is True
    assert 0 < doc["summary"]["num_requests"] < 200 and doc["summary"]["num_ok"] >= 1


def test_duration_bounds_the_run(server_url, tmp_path):
    out = tmp_path / "short"
    t0 = time.perf_counter()
    assert main(["--url", server_url, "--rate", "10", "--num-requests", "500", "--duration", "1.0",
                 "--out", str(out), *COMMON]) == 0
    assert time.perf_counter() - t0 < 15
    assert 3 <= load(out)["summary"]["num_requests"] < 40


def test_tandem_cli_routes_to_loadgen(server_url, tmp_path):
    from cluster.cli import main as tandem_main

    out = tmp_path / "via-tandem"
    assert tandem_main(["loadgen", "--url", server_url, "--num-requests", "2", "--out", str(out), *COMMON]) == 0
    assert load(out)["summary"]["num_ok"] == 2
