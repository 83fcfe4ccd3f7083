"""A fleet of timing-model workers on this machine: ``tandem serve --sim`` with many workers under load.

    .venv/bin/python tests/bench/bench_sim_fleet.py [--prefill 8] [--decode 24] [--rate 6] [--seconds 60]

Starts the cluster (Ray actors, Redis, router, controller) with every worker a timing model of a formula
profile, drives Poisson load through loadgen's runner, and prints the start-up time, the memory the
workers take, what loadgen measured and what ``tandem plan``'s simulation predicts for the same split.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from cluster.cluster_sim import SimSpec  # noqa: E402
from cluster.planner import predict  # noqa: E402
from loadgen.client import ClientConfig  # noqa: E402
from loadgen.metrics import RequestRecord, summarize  # noqa: E402
from loadgen.runner import run_workload  # noqa: E402
from loadgen.tokens import TokenText, load_tokenizer  # noqa: E402
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload  # noqa: E402
from router.slo_window import SLOTargets  # noqa: E402
from tests.cluster.processes import start_serve, stop_group, wait_ready  # noqa: E402
from tests.cluster.profiles import linear_profile  # noqa: E402

SLO = SLOTargets(ttft_s=1.0, tpot_s=0.1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=8)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--rate", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--input-len", type=int, default=300)
    ap.add_argument("--output-len", type=int, default=48)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tandem-fleet-"))
    profile = linear_profile(prefill_base_s=0.02, prefill_per_token_s=1e-3, decode_base_s=0.02,
                             decode_per_seq_s=0.005, decode_per_ctx_token_s=0.0)
    profile.save(tmp / "profile.json")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pool = {"min_replicas": 0, "resources": {"num_cpus": 0.05, "torch_threads": 1}}
    config = {"name": "fleet", "model": {"served_name": "tandem-sim"},
              "prefill": {**pool, "replicas": args.prefill, "max_replicas": max(args.prefill, 1)},
              "decode": {**pool, "replicas": args.decode, "min_replicas": 1, "max_replicas": args.decode},
              "ray": {"num_cpus": 4}, "router": {"port": port}, "slo": {"ttft_ms": 1000, "tpot_ms": 100}}
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    proc = start_serve(tmp / "serve.log", "-c", str(tmp / "cluster.yaml"), "--sim", str(tmp / "profile.json"))
    try:
        wait_ready(proc, url, tmp / "serve.log", timeout_s=900)
        startup_s = time.perf_counter() - started
        memory_mb = _ray_workers_rss_mb()
        spec = WorkloadSpec(num_requests=round(args.rate * args.seconds), rate=args.rate, seed=0,
                            input_len=LengthSpec("fixed", args.input_len),
                            output_len=LengthSpec("fixed", args.output_len))
        records: list[RequestRecord] = []
        cfg = ClientConfig(url, "tandem-sim", api="completions", timeout_s=120)
        duration = asyncio.run(run_workload(cfg, build_workload(spec, TokenText(load_tokenizer(None))), records))
        measured = summarize(records, duration, SLO.ttft_s * 1000, SLO.tpot_s * 1000)
    finally:
        stop_group(proc)
    predicted = predict(profile, SimSpec(args.rate, args.input_len, args.output_len, len(records)), SLO,
                        args.prefill, args.decode)
    each = memory_mb / (args.prefill + args.decode)
    print(f"{args.prefill} prefill + {args.decode} decode timing-model workers: ready in {startup_s:.0f} s, "
          f"{memory_mb:.0f} MB resident in Ray worker processes ({each:.0f} MB each)")
    print(f"loadgen: {len(records)} requests at {args.rate:g}/s, {measured['num_errors']} errors, attainment "
          f"{measured['slo_attainment']:.1%}, goodput {measured['goodput_rps']:.2f} req/s, TTFT p50 "
          f"{measured['ttft_ms']['p50']:.0f} ms, TPOT p50 {measured['tpot_ms']['p50']:.0f} ms")
    print(f"plan's simulation of the same split: attainment {predicted.attainment:.1%}, goodput "
          f"{predicted.goodput_rps:.2f} req/s, TTFT p50 {predicted.ttft_p50_s * 1000:.0f} ms "
          f"(goodput measured / predicted {measured['goodput_rps'] / max(predicted.goodput_rps, 1e-9):.2f})")


def _ray_workers_rss_mb() -> float:
    out = subprocess.run(["ps", "-eo", "rss,comm"], capture_output=True, text=True).stdout
    return sum(int(line.split()[0]) for line in out.splitlines()[1:]
               if "PrefillWor" in line or "DecodeWork" in line) / 1024


if __name__ == "__main__":
    main()
