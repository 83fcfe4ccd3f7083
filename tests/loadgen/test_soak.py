"""Issue 22, item 6 at a small size: ``tandem soak`` against ``tandem serve --sim`` (real Ray, Redis, router,
controller, engine and transfers; timing-model forward passes). Requests cancelled before their first token
and mid-stream, a decode worker SIGKILLed every few seconds: no request fails, no KV block is held
afterwards, every block pool is intact, and the soak's report says so (its exit status too)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from loadgen.soak import CancelPoint, plan_cancels
from loadgen.tokens import TokenText, WordTokenizer
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload
from tests.cluster.processes import start_serve, stop_group, wait_ready
from tests.cluster.profiles import linear_profile
from tests.router.serve import free_port


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


@pytest.mark.slow
def test_soak_with_cancels_and_decode_worker_kills_leaves_nothing_held(tmp_path: Path):
    port = free_port()
    profile = linear_profile(prefill_base_s=0.01, prefill_per_token_s=5e-4, decode_base_s=0.02,
                             decode_per_seq_s=0.004, decode_per_ctx_token_s=0.0)
    profile.save(tmp_path / "profile.json")
    pool = {"min_replicas": 1, "max_replicas": 3, "unresponsive_timeout_s": 5.0,
            "resources": {"num_cpus": 0.25, "torch_threads": 1}}
    config = {"name": "soaktest", "sim_profile": str(tmp_path / "profile.json"),
              "model": {"served_name": "tandem-sim"}, "prefill": {**pool, "replicas": 1},
              "decode": {**pool, "replicas": 2}, "ray": {"num_cpus": 4},
              "router": {"port": port, "local_prefill_max_tokens": 16}}
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "serve.log"
    proc = start_serve(log, "-c", str(tmp_path / "cluster.yaml"))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        soak = subprocess.run(
            [sys.executable, "-m", "cluster.cli", "soak", "--url", url, "--num-requests", "120", "--rate", "6",
             "--input-len", "uniform:8:200", "--output-len", "uniform:8:48", "--cancel-share", "0.3",
             "--kill-decode-every", "6", "--tokenizer", "words", "--rss-tolerance", "0.5", "--seed", "5",
             "--out", str(tmp_path / "soak")],
            capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    finally:
        stopped = stop_group(proc, dump_stacks=True)
    report_path = tmp_path / "soak" / "report.json"
    assert report_path.exists(), soak.stderr[-3000:] + log.read_text()[-3000:]
    report = json.loads(report_path.read_text())
    print(json.dumps({k: report[k] for k in ("completed", "cancelled_on_purpose", "failed", "kills", "memory",
                                             "checks")}, indent=1))
    assert report["failed"] == 0, report["failures"]
    assert report["checks"] == {"no_failed_requests": True, "no_blocks_held": True, "block_pools_intact": True,
                                "rss_flat": True}, (report, log.read_text()[-3000:])
    assert soak.returncode == 0, soak.stderr[-3000:]
    cancelled = report["cancelled_on_purpose"]
    assert cancelled["before_first_token"] >= 3 and cancelled["mid_stream"] >= 10, cancelled
    assert len(report["kills"]) >= 2 and report["completed"] + sum(cancelled.values()) == 120
    assert len(report["workers_after"]) == 3  # the killed workers were replaced
    assert stopped == (0, False), log.read_text()[-3000:]
