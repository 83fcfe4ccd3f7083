"""Multi-turn chats on two decode workers: what keeping a conversation on the decode worker that caches it saves.

    .venv/bin/python tests/bench/bench_conversations.py [--slacks 0,4] [--rounds 2] [--conversations 12]
        [--concurrency 4] [--out runs/conversations]

`tandem serve` on the default YAML with two decode workers of one core each (no prefill worker: each
prefills locally), once per ``router.decode_affinity_slack`` in ``--slacks`` a round, the slacks taking turns
round by round (this machine's pace drifts). Each run drives the same seeded ``tandem loadgen`` workload: closed
loop, chats of 3 turns (each turn sent with the conversation's history: the earlier prompts and answers),
first prompts of 200-400 tokens, 64-128 output tokens, SLO TTFT <= 2 s and TPOT <= 100 ms. Printed a run and
as medians a slack: SLO attainment, TTFT and TPOT p50/p90, and from the router's /metrics the prompt tokens
the workers computed and those their prefix caches served. At slack 0 a turn goes to the less busy decode
worker, which recomputes the history when it is not the one caching it.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.bench.bench_goodput import log, read_point, start_tandem, stop, wait_ready  # noqa: E402

PORT = 8000  # the default YAML's port: the workers' metrics ports follow it


def config_with_slack(slack: int, directory: Path) -> str:
    """deploy/local-cpu.yaml with two one-core decode workers and the given slack."""
    config = yaml.safe_load((ROOT / "deploy" / "local-cpu.yaml").read_text())
    config["decode"]["replicas"] = 2
    config["decode"]["resources"].update(num_cpus=1, torch_threads=1)
    config["router"]["decode_affinity_slack"] = slack
    path = directory / f"two-decoders-slack-{slack}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def metric_total(text: str, name: str) -> float:
    """A sample summed over its labels (every worker's)."""
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def run(slack: int, args: argparse.Namespace, out: Path, configs: Path) -> dict[str, float]:
    url = f"http://127.0.0.1:{PORT}"
    out.mkdir(parents=True, exist_ok=True)
    proc = start_tandem(PORT, config_with_slack(slack, configs), out)
    try:
        wait_ready(url, proc, timeout_s=300)
        deadline = time.monotonic() + 120  # the second decode worker may load after the first
        while httpx.get(f"{url}/ready", timeout=5).json().get("decode_workers", 0) < 2:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the second decode worker did not come up")
            time.sleep(1)
        cmd = [sys.executable, "-m", "loadgen", "--url", url, "--concurrency", str(args.concurrency),
               "--num-requests", str(args.conversations), "--turns", "3", "--input-len", "uniform:200:400",
               "--output-len", "uniform:64:128", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100", "--seed",
               str(args.seed), "--no-progress", "--out", str(out)]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
    finally:
        stop(proc)
    point = read_point(out)
    point["computed"] = metric_total(metrics, "tandem_prefill_tokens_total")
    point["cached"] = metric_total(metrics, "tandem_prefix_cache_hit_tokens_total")
    return point


def row(label: str, p: dict[str, float]) -> str:
    return (f"{label:<16} {p['attainment'] * 100:>6.1f}% {p['ttft_p50']:>7.0f} {p['ttft_p90']:>7.0f} "
            f"{p['tpot_p50']:>6.0f} {p['tpot_p90']:>6.0f} {p['computed']:>9.0f} {p['cached']:>9.0f} "
            f"{p['errors']:>6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slacks", default="0,4", help="router.decode_affinity_slack values to compare")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in flight")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--out", default="runs/conversations")
    args = ap.parse_args()
    slacks = [int(s) for s in args.slacks.split(",")]
    points: dict[int, list[dict[str, float]]] = {s: [] for s in slacks}
    header = (f"{'run':<16} {'SLO met':>7} {'TTFT50':>7} {'TTFT90':>7} {'TPOT50':>6} {'TPOT90':>6} "
              f"{'computed':>9} {'cached':>9} {'errors':>6}")
    lines = []
    with tempfile.TemporaryDirectory() as configs:
        for r in range(args.rounds):
            for slack in slacks:
                log(f"round {r + 1}: slack {slack}")
                points[slack].append(run(slack, args, Path(args.out) / f"slack{slack}-round{r + 1}", Path(configs)))
                lines.append(row(f"slack {slack} r{r + 1}", points[slack][-1]))
                log(lines[-1])
    print(f"{args.conversations} chats of 3 turns, {args.concurrency} at a time, on 2 decode workers of one core; "
          "TTFT/TPOT in ms, prompt tokens computed and served from cache (all workers)")
    print(header)
    print("\n".join(lines))
    medians = {s: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for s, ps in points.items()}
    for slack, p in medians.items():
        print(row(f"slack {slack} median", p))
    if len(slacks) == 2:
        a, b = (medians[s] for s in slacks)
        print(f"slack {slacks[1]} vs {slacks[0]}: TTFT p50 x{b['ttft_p50'] / a['ttft_p50']:.2f}, "
              f"p90 x{b['ttft_p90'] / a['ttft_p90']:.2f}; prompt tokens computed x{b['computed'] / a['computed']:.2f}")


if __name__ == "__main__":
    main()
