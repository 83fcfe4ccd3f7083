"""``tandem plan``: the fewest prefill and decode workers that meet the SLO at a rate, found by simulating
the cluster on a timing profile (``cluster/planner.py``), with the KV sizing, and optionally a cluster YAML."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from cluster.calibration import CalibrationError, fit_scales, load_run
from cluster.cluster_sim import SimSpec
from cluster.planner import Plan, find_plan, predict
from router.slo_window import SLOTargets
from workers.protocol.timing_profile import ProfileError, TimingProfile


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="the fewest workers that meet the SLO at a rate (simulated on a profile)")
    p.add_argument("--profile", required=True, help="a timing profile (tandem profile --out FILE)")
    p.add_argument("--rate", type=float, required=True, help="arrivals per second (Poisson)")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens per request (mean)")
    p.add_argument("--output-len", type=int, required=True, help="output tokens per request")
    p.add_argument("--input-jitter", type=float, default=0.0, help="prompt lengths uniform within +- this share")
    p.add_argument("--slo-ttft-ms", type=float, required=True)
    p.add_argument("--slo-tpot-ms", type=float, required=True)
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet the SLO")
    p.add_argument("--max-workers", type=int, default=24)
    p.add_argument("--num-requests", type=int, default=600, help="requests simulated per split")
    p.add_argument("--corrections", metavar="TTFT,TPOT", help="scale the profile's prompt and decode times by these "
                   "(a running cluster's autoscaler.corrections in tandem status, on this hardware)")
    p.add_argument("--calibrate", metavar="REPORT", help="fit the corrections to a tandem loadgen report.json measured "
                   "on this hardware (its requests replayed through the simulation; see cluster/calibration.py)")
    p.add_argument("--calibrate-split", metavar="PREFILL,DECODE", help="the workers that served --calibrate's run "
                   "(default: --prefill/--decode)")
    p.add_argument("--prefill", type=int, help="with --decode: predict this split instead of searching")
    p.add_argument("--decode", type=int)
    p.add_argument("--json", action="store_true", help='print {"prefill": P, "decode": D, ...} only')
    p.add_argument("--out", help="write a cluster YAML of the plan (tandem serve -c accepts it)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        profile = TimingProfile.load(args.profile)
    except ProfileError as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    problem = _check(args)
    if problem:
        print(f"tandem plan: {problem}", file=sys.stderr)
        return 2
    if args.calibrate:
        try:
            ttft_scale, tpot_scale = _calibrate(profile, args)
        except CalibrationError as e:
            print(f"tandem plan: {e}", file=sys.stderr)
            return 2
    else:
        ttft_scale, tpot_scale = _corrections(args.corrections)
    spec = SimSpec(args.rate, args.input_len, args.output_len, args.num_requests, args.input_jitter,
                   prefill_scale=ttft_scale, decode_scale=tpot_scale)
    slo = SLOTargets(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)
    if args.decode is not None:
        plan: Plan | None = predict(profile, spec, slo, args.prefill or 0, args.decode)
    else:
        plan = find_plan(profile, spec, slo, args.attainment, args.max_workers)
    if plan is None:
        print(f"tandem plan: no split of up to {args.max_workers} workers meets the SLO for {args.attainment:.0%} "
              f"at {args.rate:g} req/s (raise --max-workers, or loosen the SLO)", file=sys.stderr)
        return 1
    report = _report(plan, profile, args)
    report["corrections"] = [ttft_scale, tpot_scale]
    if args.json:
        print(json.dumps(report))
    else:
        _print(report, args)
    if args.out:
        Path(args.out).write_text(yaml.safe_dump(_cluster_yaml(plan, args), sort_keys=False), encoding="utf-8")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


def _calibrate(profile: TimingProfile, args: argparse.Namespace) -> tuple[float, float]:
    prefill, decode = _split(args.calibrate_split) if args.calibrate_split else (args.prefill or 0, args.decode)
    run = load_run(args.calibrate)
    scales = fit_scales(profile, run, prefill, decode)
    print(f"calibrated on {args.calibrate} ({len(run.trace)} requests on {prefill} prefill + {decode} decode, "
          f"TTFT p50 {run.ttft_p50_s * 1000:.0f} ms, TPOT p50 {run.tpot_p50_s * 1000:.1f} ms): prompt time "
          f"x{scales[0]:.2f}, decode time x{scales[1]:.2f}", file=sys.stderr)
    return scales


def _split(text: str) -> tuple[int, int]:
    prefill, decode = (int(x) for x in text.split(","))
    return prefill, decode


def _corrections(text: str | None) -> tuple[float, float]:
    if text is None:
        return 1.0, 1.0
    ttft, tpot = (float(x) for x in text.split(","))
    return ttft, tpot


def _check(args: argparse.Namespace) -> str | None:
    if (args.prefill is None) != (args.decode is None) and args.decode is None:
        return "--prefill needs --decode"
    for name in ("rate", "input_len", "output_len", "slo_ttft_ms", "slo_tpot_ms", "num_requests", "max_workers"):
        if getattr(args, name) <= 0:
            return f"--{name.replace('_', '-')} must be positive"
    if not 0 < args.attainment <= 1:
        return "--attainment must be in (0, 1]"
    if args.calibrate and args.corrections:
        return "--calibrate fits the corrections: give it or --corrections, not both"
    if args.calibrate and not args.calibrate_split and args.decode is None:
        return "--calibrate needs --calibrate-split PREFILL,DECODE (the workers that served its run) or --decode"
    if args.calibrate_split is not None and not args.calibrate:
        return "--calibrate-split says which workers served --calibrate's run: give --calibrate too"
    if args.calibrate_split is not None:
        try:
            prefill, decode = _split(args.calibrate_split)
            if prefill < 0 or decode < 1:
                raise ValueError
        except ValueError:
            return "--calibrate-split takes PREFILL,DECODE: workers, at least one decode (e.g. 0,1)"
    if args.corrections is not None:
        try:
            if min(_corrections(args.corrections)) <= 0:
                raise ValueError
        except ValueError:
            return "--corrections takes two positive numbers: TTFT,TPOT (e.g. 1.2,2.5)"
    return None


def _report(plan: Plan, profile: TimingProfile, args: argparse.Namespace) -> dict[str, Any]:
    per_request = args.input_len + args.output_len
    return {"prefill": plan.prefill, "decode": plan.decode, "local_prefill": plan.prefill == 0,
            "predicted_attainment": round(plan.attainment, 4), "predicted_goodput_rps": round(plan.goodput_rps, 3),
            "predicted_ttft_p50_ms": round(plan.ttft_p50_s * 1000, 1), "splits_simulated": plan.simulated,
            "kv_bytes_per_token": profile.kv_bytes_per_token, "kv_tokens_per_worker": profile.kv_tokens_per_worker,
            "concurrent_requests_per_worker": min(profile.max_num_seqs, profile.kv_tokens_per_worker // per_request),
            "profile": {"device": profile.device, "model": profile.model}}


def _print(r: dict[str, Any], args: argparse.Namespace) -> None:
    shape = "local prefill on the decode workers" if r["local_prefill"] else f"{r['prefill']} prefill"
    print(f"plan at {args.rate:g} req/s ({args.input_len} prompt + {args.output_len} output tokens, "
          f"SLO TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms):")
    print(f"  workers      {shape} + {r['decode']} decode")
    print(f"  predicted    {r['predicted_attainment']:.1%} attainment, {r['predicted_goodput_rps']:.3f} req/s "
          f"goodput, TTFT p50 {r['predicted_ttft_p50_ms']:.0f} ms ({r['splits_simulated']} splits simulated)")
    print(f"  KV sizing    {r['kv_bytes_per_token']} bytes/token, {r['kv_tokens_per_worker']} tokens/worker, "
          f"{r['concurrent_requests_per_worker']} concurrent requests/worker")
    print(f"  profile      {r['profile']['device']}, {r['profile']['model']}")


def _cluster_yaml(plan: Plan, args: argparse.Namespace) -> dict[str, Any]:
    def pool(replicas: int, floor: int) -> dict[str, int]:
        return {"replicas": replicas, "min_replicas": min(replicas, floor), "max_replicas": max(2 * replicas, 1)}

    return {"name": "planned", "prefill": pool(plan.prefill, 1), "decode": pool(plan.decode, 1),
            "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.attainment},
            "autoscaler": {"enabled": True, "profile": str(Path(args.profile).resolve())}}
