"""Goodput at a chat SLO: the default ``tandem serve`` against llama.cpp's ``llama-server`` on this machine.

    .venv/bin/python tests/bench/bench_goodput.py [--rates 0.1,0.3,0.6,1.0,1.4,2,3,4.5] [--num-requests 24]
        [--seconds 60] [--llama-server PATH] [--config YAML] [--temperature T] [--top-p P] [--out runs/goodput]
        [--report-only]

Both servers run the bundled SmolLM2-135M GGUF, one after the other, driven by the same seeded
``tandem loadgen`` workload at each rate: Poisson arrivals, new prompts of 200-500 tokens for every
request (each rate its own seed, so neither server's prompt cache hits), 64-256 output tokens, a
quarter of the chats sent without max_tokens (they end at EOS or max_model_len), greedy unless --temperature
(and --top-p) ask for sampled tokens, as chat clients do. A request meets the
SLO with TTFT <= 2 s and TPOT <= 100 ms. Capacity is the highest rate up to which every rate swept has
>= 90% meeting it (at the highest rate swept, only a lower bound: printed "at least"); the ratio of
capacities is the figure of issue 20 (target >= 1.5). The same runs are
also read at the issue's looser SLO (TTFT <= 5 s, TPOT <= 250 ms), where a peer that meets the chat SLO at
no rate still has a capacity. Each rate sends at least rate x --seconds requests (a short burst at a high
rate ends before the queue it builds shows), and a server's sweep stops after a rate where fewer than half
meet even the looser SLO.

llama-server is not a Python package: build it with the recipe in ../shared/PEERS.md and pass its
path (or set LLAMA_SERVER). Without it the bench measures Tandem alone and says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadgen.metrics import RequestRecord  # noqa: E402
from workers.model.loader import default_model_path  # noqa: E402

SLO_TTFT_MS, SLO_TPOT_MS, TARGET = 2000.0, 100.0, 0.9
# The looser SLO, read off the same runs: where a peer meets the chat SLO at no rate (llama.cpp here:
# a prompt of ~400 tokens alone takes it over 2 s), this one still gives a capacity ratio.
LOOSE_TTFT_MS, LOOSE_TPOT_MS = 5000.0, 250.0
STOP_BELOW = 0.5  # a server's sweep stops after a rate where fewer meet even the looser SLO


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server at {url} not ready within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_tandem(port: int, config: str | None, log_dir: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)]
    if config:
        cmd += ["--config", config]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log_dir / "tandem.log", "wb"), stderr=subprocess.STDOUT)


def start_llama(binary: str, port: int, log_dir: Path, threads: int = 2) -> subprocess.Popen[bytes]:
    cmd = [binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
           "-np", "8", "-c", "16384", "--alias", "SmolLM2-135M-Instruct"]
    return subprocess.Popen(cmd, stdout=open(log_dir / "llama.log", "wb"), stderr=subprocess.STDOUT)


def loose_attainment(report: dict[str, Any]) -> float:
    """The share of a run's requests that meet the looser SLO (loadgen's own rule, at other bounds)."""
    names = {f.name for f in fields(RequestRecord)}
    records = [RequestRecord(**{k: v for k, v in r.items() if k in names}) for r in report["requests"]]
    return sum(r.meets_slo(LOOSE_TTFT_MS, LOOSE_TPOT_MS) for r in records) / max(1, len(records))


def run_rate(url: str, rate: float, seed: int, num_requests: int, out: Path, sampling: list[str]) -> dict[str, float]:
    cmd = [sys.executable, "-m", "loadgen", "--url", url, "--rate", str(rate), "--num-requests", str(num_requests),
           "--input-len", "uniform:200:500", "--output-len", "uniform:64:256", "--open-ended", "0.25",
           "--slo-ttft-ms", str(SLO_TTFT_MS), "--slo-tpot-ms", str(SLO_TPOT_MS), "--seed", str(seed),
           *sampling, "--no-progress", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return read_point(out)


def read_point(out: Path) -> dict[str, float]:
    report = json.loads((out / "report.json").read_text())
    s = report["summary"]
    return {"attainment": s["slo_attainment"], "ttft_p50": s["ttft_ms"]["p50"], "tpot_p50": s["tpot_ms"]["p50"],
            "ttft_p90": s["ttft_ms"]["p90"], "tpot_p90": s["tpot_ms"]["p90"], "errors": s["num_errors"],
            "loose_attainment": loose_attainment(report)}


def sweep(name: str, proc: subprocess.Popen[bytes], url: str, rates: list[float], args: argparse.Namespace,
          out: Path) -> dict[float, dict[str, float]]:
    try:
        wait_ready(url, proc, timeout_s=300)
        log(f"{name} ready; warming up")
        sampling = ["--temperature", str(args.temperature)]
        if args.top_p is not None:
            sampling += ["--top-p", str(args.top_p)]
        run_rate(url, 0.5, 999, 3, out / name / "warmup", sampling)  # the process meets its shapes once
        points = {}
        for i, rate in enumerate(rates):
            points[rate] = run_rate(url, rate, 1000 + i, requests_at(rate, args), out / name / f"rate_{rate:g}",
                                    sampling)
            p = points[rate]
            log(f"{name} @ {rate:g} req/s: {p['attainment']:.0%} met, {p['loose_attainment']:.0%} at the looser "
                f"SLO; TTFT p50 {p['ttft_p50']:.0f} ms, TPOT p50 {p['tpot_p50']:.0f} ms")
            if p["loose_attainment"] < STOP_BELOW:
                log(f"{name}: past its knee even at the looser SLO; the higher rates are not run")
                break
        return points
    finally:
        stop(proc)


def requests_at(rate: float, args: argparse.Namespace) -> int:
    """Enough requests that arrivals span --seconds: a short burst at a high rate ends before the queue it
    builds shows (24 requests at 1.4 req/s met the SLO 92%; 60 at the same rate, 72%)."""
    return max(args.num_requests, round(rate * args.seconds))


def capacity(points: dict[float, dict[str, float]], key: str = "attainment") -> float:
    """The highest rate up to which every rate swept met the target (a noisy pass above a miss is not counted)."""
    best = 0.0
    for rate in sorted(points):
        if points[rate][key] < TARGET:
            break
        best = rate
    return best


def at_least(cap: float, rates: list[float]) -> str:
    """A capacity at the highest rate swept is only a lower bound: the knee lies above the sweep."""
    return "at least " if cap == max(rates) else ""


def rate_text(cap: float, rates: list[float]) -> str:
    if at_least(cap, rates):
        return f"at least {cap:g} req/s (the highest rate swept: add higher --rates)"
    return f"{cap:g} req/s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Up to 4.5: a 2-core AVX2 host's Tandem passed 0.9, an AVX-512 one's 3 (a sweep stops past its knee).
    parser.add_argument("--rates", default="0.1,0.3,0.6,1.0,1.4,2,3,4.5")
    parser.add_argument("--num-requests", type=int, default=24, help="the fewest requests a rate")
    parser.add_argument("--seconds", type=float, default=60.0,
                        help="each rate sends at least rate x seconds requests (arrivals over about this long)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"))
    parser.add_argument("--config", default=None, help="tandem cluster YAML (default: the built-in default)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sent with every request to both servers (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=None, help="sent with every request where given")
    parser.add_argument("--out", default="runs/goodput")
    parser.add_argument("--report-only", action="store_true",
                        help="print the tables from the runs already under --out (no servers started)")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[float, dict[str, float]]] = {}
    if args.report_only:
        for name in ("tandem", "llama.cpp"):
            if (out / name).is_dir():
                results[name] = {r: read_point(out / name / f"rate_{r:g}") for r in rates
                                 if (out / name / f"rate_{r:g}" / "report.json").is_file()}
    else:
        results["tandem"] = sweep("tandem", start_tandem(8100, args.config, out), "http://127.0.0.1:8100", rates,
                                  args, out)
        if args.llama_server:
            results["llama.cpp"] = sweep("llama.cpp", start_llama(args.llama_server, 8200, out),
                                         "http://127.0.0.1:8200", rates, args, out)
        else:
            log("no llama-server given (--llama-server or LLAMA_SERVER): Tandem alone")
    print(f"sampling: temperature {args.temperature:g}" + ("" if args.top_p is None else f", top_p {args.top_p:g}"))
    print(f"SLO: TTFT <= {SLO_TTFT_MS:.0f} ms, TPOT <= {SLO_TPOT_MS:.0f} ms; "
          f"{', '.join(f'{requests_at(r, args)} requests at {r:g}' for r in rates)} req/s")
    print(f"{'rate':>6} | " + " | ".join(f"{n:^38}" for n in results))
    print(f"{'req/s':>6} | " + " | ".join(f"{'met':>5} {'TTFT p50/p90 ms':>16} {'TPOT p50/p90':>14}" for _ in results))
    for rate in rates:
        cells = [f"{p['attainment']:5.0%} {p['ttft_p50']:7.0f}/{p['ttft_p90']:<8.0f} "
                 f"{p['tpot_p50']:6.0f}/{p['tpot_p90']:<7.0f}" if p else f"{'not run (past the knee)':^38}"
                 for p in (r.get(rate) for r in results.values())]
        print(f"{rate:6g} | " + " | ".join(cells))
    caps = {n: capacity(p) for n, p in results.items()}
    print("capacity (>= 90% met): " + ", ".join(f"{n} {rate_text(c, rates)}" for n, c in caps.items()))
    if "llama.cpp" in caps and caps["llama.cpp"]:
        print(f"tandem / llama.cpp capacity: {at_least(caps['tandem'], rates)}"
              f"{caps['tandem'] / caps['llama.cpp']:.2f} (target >= 1.5)")
    elif "llama.cpp" in caps:
        print("llama.cpp meets the SLO at none of these rates: no capacity ratio (add lower rates)")
    loose = {n: capacity(p, "loose_attainment") for n, p in results.items()}
    print(f"at the looser SLO (TTFT <= {LOOSE_TTFT_MS:.0f} ms, TPOT <= {LOOSE_TPOT_MS:.0f} ms), the same runs: "
          + ", ".join(f"{n} {p[r]['loose_attainment']:.0%} at {r:g}" for n, p in results.items() for r in p))
    print("capacity at the looser SLO: " + ", ".join(f"{n} {rate_text(c, rates)}" for n, c in loose.items()))
    if "llama.cpp" in loose and loose["llama.cpp"]:
        print(f"tandem / llama.cpp capacity at the looser SLO: {at_least(loose['tandem'], rates)}"
              f"{loose['tandem'] / loose['llama.cpp']:.2f}")
    (out / "summary.json").write_text(json.dumps({"rates": rates, "results": {n: {str(r): p for r, p in pts.items()}
                                                                              for n, pts in results.items()},
                                                  "capacity": caps, "capacity_loose_slo": loose}, indent=1))


if __name__ == "__main__":
    main()
