"""``tandem plan``'s predicted goodput against ``tandem loadgen``'s measurement, on the real engine here.

    .venv/bin/python tests/bench/bench_plan_accuracy.py [--profile deploy/profiles/cpu-2core-smollm2.json]
        [--calibration-rate 0.5] [--rates 0.75,1.0,1.25] [--num-requests 100] [--url URL] [--out runs/plan]

Starts the default ``tandem serve`` (0 prefill + 1 decode worker on the bundled GGUF; or uses ``--url``), runs one
seeded loadgen sweep over the calibration rate and the test rates (new prompts of 100-300 tokens, 64 output
tokens, SLO TTFT <= 2 s and TPOT <= 100 ms), then predicts each test rate with ``tandem plan``'s simulation:
uncalibrated (the profile alone), and calibrated on the calibration rate's report (``--calibrate``). Each
prediction is made twice: for the rate (Poisson arrivals and uniform lengths, as many requests as the run sent:
``tandem plan --num-requests N``) and for the test run's own arrivals and lengths (the same requests the server
saw). Target (issue 21): within 20%.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_goodput import log, stop, wait_ready  # noqa: E402

from cluster.calibration import fit_scales, load_run  # noqa: E402
from cluster.cluster_sim import SimSpec, simulate  # noqa: E402
from cluster.planner import predict  # noqa: E402
from router.slo_window import SLOTargets  # noqa: E402
from workers.protocol.timing_profile import TimingProfile  # noqa: E402

SLO = SLOTargets(2.0, 0.1)
INPUT_LO, INPUT_HI, OUTPUT = 100, 300, 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default=str(ROOT / "deploy/profiles/cpu-2core-smollm2.json"))
    p.add_argument("--calibration-rate", type=float, default=0.5)
    p.add_argument("--rates", default="0.75,1.0,1.25")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=907)
    p.add_argument("--url", help="a running server (0 prefill + 1 decode) instead of starting tandem serve")
    p.add_argument("--out", default="runs/plan-accuracy")
    p.add_argument("--predict-only", action="store_true", help="--out holds the sweep already: predict only")
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    out = Path(args.out)
    if not args.predict_only:
        measure(args, url=args.url or "http://127.0.0.1:8019", rates=rates, out=out)
    predict_rates(TimingProfile.load(args.profile), args.calibration_rate, rates, out)
    return 0


def measure(args: argparse.Namespace, url: str, rates: list[float], out: Path) -> None:
    server = None
    if not args.url:
        log("starting tandem serve (0 prefill + 1 decode)")
        server = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", "8019"], cwd=ROOT)
        wait_ready(url, server, 300)
    try:
        sweep = ",".join(str(r) for r in [args.calibration_rate, *rates])
        log(f"loadgen sweep {sweep} req/s, {args.num_requests} requests each")
        subprocess.run([sys.executable, "-m", "loadgen", "--url", url, "--api", "completions", "--sweep-rates", sweep,
                        "--num-requests", str(args.num_requests), "--input-len", f"uniform:{INPUT_LO}:{INPUT_HI}",
                        "--output-len", str(OUTPUT), "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100",
                        "--seed", str(args.seed), "--out", str(out), "--no-progress"], cwd=ROOT, check=True)
    finally:
        if server is not None:
            stop(server)


def predict_rates(profile: TimingProfile, calibration_rate: float, rates: list[float], out: Path) -> None:
    calibration = load_run(out / f"rate_{calibration_rate:g}" / "report.json")
    scales = fit_scales(profile, calibration, prefill=0, decode=1)
    print(f"calibrated on {calibration_rate:g} req/s: prompt time x{scales[0]:.2f}, decode time x{scales[1]:.2f}")
    print("| rate | measured goodput (attainment) | plan, uncalibrated | plan, calibrated | ratio | "
          "calibrated, the run's own arrivals | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for rate in rates:
        report = out / f"rate_{rate:g}" / "report.json"
        measured = load_run(report)
        summary = json.loads(report.read_text())["summary"]
        # As many requests as the run sent: past the knee a queue grows for as long as requests keep coming, so a
        # longer simulated run than the measured one predicts a lower goodput for the same rate.
        spec = SimSpec(rate, (INPUT_LO + INPUT_HI) // 2, OUTPUT, len(measured.trace),
                       (INPUT_HI - INPUT_LO) / (INPUT_HI + INPUT_LO))
        plain = predict(profile, spec, SLO, 0, 1)
        scaled = dataclasses.replace(spec, prefill_scale=scales[0], decode_scale=scales[1])
        calibrated = predict(profile, scaled, SLO, 0, 1)
        replay = simulate(profile, scaled, 0, 1, trace=measured.trace)
        goodput = summary["goodput_rps"]
        print(f"| {rate:g} | {goodput:.3f} ({summary['slo_attainment']:.0%}) | {plain.goodput_rps:.3f} "
              f"({plain.attainment:.0%}) | {calibrated.goodput_rps:.3f} ({calibrated.attainment:.0%}) | "
              f"{_ratio(calibrated.goodput_rps, goodput)} | {replay.goodput(SLO):.3f} ({replay.attainment(SLO):.0%}) | "
              f"{_ratio(replay.goodput(SLO), goodput)} |")


def _ratio(predicted: float, measured: float) -> str:
    return f"{predicted / measured:.2f}" if measured > 0 else "n/a (nothing measured met the SLO)"


if __name__ == "__main__":
    sys.exit(main())
