"""Issue 21's acceptance on timing-model workers (``tandem serve --sim``): a load step (low, then 8x, then
idle) grows the pools within three intervals, attainment is back to 90% within the step, the pools
shrink to their minimum after the idle delay, no request fails, and no pool changes direction more
than once per step."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import yaml

from loadgen.client import ClientConfig
from loadgen.metrics import RequestRecord
from loadgen.runner import run_workload
from loadgen.tokens import TokenText, WordTokenizer
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload
from tests.cluster.processes import start_serve, stop_group, wait_ready
from tests.cluster.profiles import linear_profile
from tests.router.serve import free_port as free_tcp_port

pytestmark = pytest.mark.scenario

INTERVAL_S = 2.0
DELAY_S = 10.0
LOW_RATE, HIGH_RATE = 0.5, 4.0
LOW_S, HIGH_S = 12.0, 40.0


def write_cluster(tmp_path: Path, port: int) -> Path:
    # Prompts of ~200 tokens take 0.22 s each: one prefill worker is 88% busy at 4 req/s, two keep TTFT
    # within the SLO. Decode steps take 20 ms + 10 ms per request: one worker cannot keep up at 4 req/s.
    profile = linear_profile(prefill_base_s=0.02, prefill_per_token_s=1e-3, decode_base_s=0.02,
                             decode_per_seq_s=0.01, decode_per_ctx_token_s=0.0)
    profile_path = tmp_path / "profile.json"
    profile.save(profile_path)
    pool = {"replicas": 1, "min_replicas": 1, "resources": {"num_cpus": 0.25, "torch_threads": 1}}
    config = {"name": "simtest", "sim_profile": str(profile_path), "model": {"served_name": "tandem-sim"},
              "prefill": {**pool, "max_replicas": 3}, "decode": {**pool, "max_replicas": 4},
              "ray": {"num_cpus": 4}, "router": {"port": port},
              "slo": {"ttft_ms": 1000, "tpot_ms": 100},
              "autoscaler": {"enabled": True, "interval_s": INTERVAL_S, "scale_down_delay_s": DELAY_S}}
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def drive(url: str, rate: float, seconds: float, seed: int) -> list[RequestRecord]:
    spec = WorkloadSpec(num_requests=max(1, round(rate * seconds)), input_len=LengthSpec("uniform", 120, 200),
                        output_len=LengthSpec("fixed", 32), rate=rate, seed=seed)
    records: list[RequestRecord] = []
    cfg = ClientConfig(url, "tandem-sim", api="completions", timeout_s=120)
    asyncio.run(run_workload(cfg, build_workload(spec, TokenText(WordTokenizer())), records))
    return records


def status(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(f"{url}/cluster/status", timeout=10).json()


def test_a_load_step_grows_the_pools_then_they_shrink_back(tmp_path):
    free_port = free_tcp_port()
    url = f"http://127.0.0.1:{free_port}"
    log = tmp_path / "serve.log"
    proc = start_serve(log, "-c", str(write_cluster(tmp_path, free_port)), "--sim",
                       str(tmp_path / "profile.json"))
    try:
        wait_ready(proc, url, log)
        low = drive(url, LOW_RATE, LOW_S, seed=1)
        high_start = time.time()
        high = drive(url, HIGH_RATE, HIGH_S, seed=2)
        idle_start = time.time()
        deadline = idle_start + DELAY_S + 60
        while time.time() < deadline:
            now = status(url)
            if now["targets"] == {"prefill": 1, "decode": 1} and not now["draining"]:
                break
            time.sleep(1)
        final = status(url)
    finally:
        stop_group(proc)
    text = log.read_text()
    assert final["targets"] == {"prefill": 1, "decode": 1} and not final["draining"], text[-3000:]
    failed = [r.error for r in low + high if not r.ok]
    assert failed == [], failed[:5]
    decisions = final["autoscaler"]["decisions"]
    for d in decisions:
        print(f"{d['at'] - high_start:+7.1f} s  {d['role']} {d['from']} -> {d['to']}: {d['reason']}")
    ups = [d for d in decisions if d["to"] > d["from"]]
    downs = [d for d in decisions if d["to"] < d["from"]]
    assert ups and min(d["at"] for d in ups) <= high_start + 3 * INTERVAL_S + 1, decisions
    assert all(high_start - 1 <= d["at"] <= idle_start + 1 for d in ups), decisions  # up only in the step
    # Down only after a whole delay without need: a pool over-grown by a burst may come back down late in the
    # step (the one change of direction the step allows), the rest once idle.
    assert downs and max(d["at"] for d in downs) >= idle_start, decisions
    assert all(d["at"] >= high_start + DELAY_S for d in downs), decisions
    for role in ("prefill", "decode"):  # one change of direction at most: ups, then downs
        moves = ["up" if d["to"] > d["from"] else "down" for d in decisions if d["role"] == role]
        assert moves == sorted(moves, key=lambda m: m == "down"), (role, moves)
    late = [r for r in high if r.arrival_s >= HIGH_S * 0.6]  # the step's last 40%, the pools grown
    met = sum(r.meets_slo(1000, 100) for r in late) / len(late)
    print(f"\nlate-step attainment {met:.0%} over {len(late)} requests; decisions: {decisions}")
    assert met >= 0.9, (met, decisions)
