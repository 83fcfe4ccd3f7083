"""``tandem loadgen`` (or ``python -m loadgen``): goodput under SLOs against any OpenAI-compatible server.

    tandem loadgen --url http://127.0.0.1:8000 --rate 2 --num-requests 100 --out runs/a
    tandem loadgen --url ... --sweep-rates 0.5,1,2,4 --out runs/sweep
    tandem loadgen --url ... --find-capacity --rate 1 --out runs/cap
    tandem loadgen compare runs/a runs/b --out runs/compare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx

from loadgen.client import ClientConfig
from loadgen.metrics import RequestRecord, summarize
from loadgen.report import capacity, compare, plot_goodput, write_run_report
from loadgen.runner import LiveProgress, run_workload
from loadgen.tokens import TokenText, load_tokenizer
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model from /v1/models")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (default: $TANDEM_API_KEY, else "
                   "$OPENAI_API_KEY)")
    load = p.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, default=None, help="requests/s (open loop)")
    load.add_argument("--concurrency", type=int, default=None, help="closed loop: requests in flight")
    p.add_argument("--arrival", default="poisson", choices=["poisson", "gamma", "constant"])
    p.add_argument("--cv", type=float, default=1.0, help="gamma arrivals: coefficient of variation")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    p.add_argument("--input-len", default="256", help="N | uniform:LO:HI | lognormal:MEAN:SD | jsonl:FILE:FIELD")
    p.add_argument("--output-len", default="128")
    p.add_argument("--prefix-groups", type=int, default=0, help="N shared system prompts")
    p.add_argument("--prefix-len", type=int, default=512, help="tokens of each shared system prompt")
    p.add_argument("--turns", type=int, default=1, help="turns per conversation (multi-turn)")
    p.add_argument("--open-ended", type=float, default=0.0,
                   help="share of requests sent without max_tokens (chats that end at EOS or the model's length)")
    p.add_argument("--api", default="chat", choices=["chat", "completions"])
    p.add_argument("--tokenizer", default=None,
                   help='HF dir or .gguf for exact token lengths; "words" to count words (default: bundled model)')
    p.add_argument("--no-ignore-eos", action="store_true", help="don't send ignore_eos")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sent in every request (default 0: greedy; chat clients send ~0.7-1)")
    p.add_argument("--top-p", type=float, default=None, help="sent in every request where given (e.g. 0.9)")
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep-rates", default=None, help="comma-separated rates: one run each")
    p.add_argument("--find-capacity", action="store_true", help="search the highest rate meeting --target")
    p.add_argument("--target", type=float, default=0.9, help="SLO attainment target (capacity)")
    p.add_argument("--label", default=None, help="name of this run on compare plots")
    p.add_argument("--out", required=True, help="report directory")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    except KeyboardInterrupt:  # during set-up, before any request went out
        print("tandem loadgen: interrupted before the run started; nothing to report", file=sys.stderr)
        return 130


def _main(argv: list[str]) -> int:
    if argv[:1] == ["compare"]:
        cp = argparse.ArgumentParser(prog="tandem loadgen compare")
        cp.add_argument("dirs", nargs="+", type=Path)
        cp.add_argument("--out", required=True, type=Path)
        args = cp.parse_args(argv[1:])
        for f in compare(args.dirs, args.out):
            print(f)
        return 0
    args = build_parser().parse_args(argv)
    if args.rate is None and args.concurrency is None and not args.sweep_rates:
        args.concurrency = 1
    try:
        spec = WorkloadSpec(num_requests=args.num_requests, input_len=LengthSpec.parse(args.input_len),
                            output_len=LengthSpec.parse(args.output_len), arrival=args.arrival, rate=args.rate,
                            cv=args.cv, prefix_groups=args.prefix_groups, prefix_len=args.prefix_len,
                            turns=args.turns, seed=args.seed, open_ended=args.open_ended)
    except ValueError as e:
        print(f"tandem loadgen: error: {e}", file=sys.stderr)
        return 2
    if not 0.0 <= args.temperature <= 2.0 or (args.top_p is not None and not 0.0 < args.top_p <= 1.0):
        print("tandem loadgen: error: --temperature must be in [0, 2] and --top-p in (0, 1]", file=sys.stderr)
        return 2
    model = args.model or first_model(args.url, api_key(args))
    cfg = ClientConfig(args.url, model, args.api, args.timeout, not args.no_ignore_eos, args.temperature,
                       api_key=api_key(args), top_p=args.top_p)
    text = TokenText(load_tokenizer(args.tokenizer))
    out = Path(args.out)
    if args.sweep_rates or args.find_capacity:
        rates = [float(r) for r in args.sweep_rates.split(",")] if args.sweep_rates else None
        points = sweep(args, cfg, spec, text, out, rates)
        print(json.dumps({"capacity_rps": capacity(points, args.target), "points": points}, indent=1))
        return 0
    summary = run_once(args, cfg, spec, text, out)
    print(json.dumps({k: summary[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "slo_attainment",
                                              "goodput_rps", "output_tokens_per_s", "num_errors")}, indent=1))
    return 0


def api_key(args: argparse.Namespace) -> str | None:
    return args.api_key or os.environ.get("TANDEM_API_KEY") or os.environ.get("OPENAI_API_KEY")


def first_model(url: str, key: str | None = None) -> str:
    base = url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    try:
        headers = {"Authorization": f"Bearer {key}"} if key else None
        data = httpx.get(base + "/models", timeout=10, headers=headers).json()["data"]
        return str(data[0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise SystemExit(f"tandem loadgen: cannot read the model list from {base}/models ({e}); pass --model") from e


def run_once(args: argparse.Namespace, cfg: ClientConfig, spec: WorkloadSpec, text: TokenText,
             out: Path) -> dict[str, Any]:
    """One run; Ctrl-C stops it and the report is written from what was collected."""
    workload = build_workload(spec, text)
    records: list[RequestRecord] = []
    duration = 0.0
    interrupted = False
    total = sum(len(p.turns) for p in workload)
    concurrency = None if spec.rate else (args.concurrency or 1)
    print(f"[loadgen] running {total} requests against {cfg.endpoint}", file=sys.stderr, flush=True)
    sigint = asyncio.Event()

    async def main() -> float:
        # Our own Ctrl-C handler: it marks the run interrupted however the cancellation then unwinds (asyncio's
        # own turns it into KeyboardInterrupt only when the main task ends cancelled; once in a full suite's
        # run the report said "interrupted": false).
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def on_sigint() -> None:
            sigint.set()
            task.cancel()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            return await run_workload(cfg, workload, records, concurrency=concurrency, duration_s=args.duration,
                                      progress=progress)
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    with LiveProgress(total, enabled=not args.no_progress) as progress:
        try:
            duration = asyncio.run(main())
        except (KeyboardInterrupt, asyncio.CancelledError):
            sigint.set()
        if sigint.is_set():
            interrupted = True
            for r in records:
                if r.end_s is None:
                    r.error = r.error or "cancelled: the run was interrupted"
            duration = max((r.end_s or r.send_s or 0.0 for r in records), default=0.0)
    summary = summarize(records, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    config = {"url": args.url, "model": cfg.model, "api": cfg.api, "rate": spec.rate,
              "concurrency": concurrency, "label": args.label,
              "interrupted": interrupted, "workload": _spec_json(spec), "seed": spec.seed,
              "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p}}
    for f in write_run_report(out, config, summary, records):
        print(f"[loadgen] wrote {f}", file=sys.stderr)
    return summary


def sweep(args: argparse.Namespace, cfg: ClientConfig, spec: WorkloadSpec, text: TokenText, out: Path,
          rates: list[float] | None) -> list[dict[str, Any]]:
    """Runs at each rate; or, with ``rates`` None, doubling then bisecting to the capacity."""
    points: list[dict[str, Any]] = []

    def measure(rate: float) -> dict[str, Any]:
        # Each point its own seed: the same prompts again would be prefix-cache hits, not new requests.
        point_spec = replace(spec, rate=rate, seed=spec.seed + len(points))
        summary = run_once(args, cfg, point_spec, text, out / f"rate_{rate:g}")
        point = {"rate": rate, "goodput_rps": summary["goodput_rps"], "slo_attainment": summary["slo_attainment"],
                 "ttft_p90_ms": summary["ttft_ms"]["p90"], "tpot_p90_ms": summary["tpot_ms"]["p90"]}
        points.append(point)
        print(f"[loadgen] rate {rate:g}: attainment {point['slo_attainment']:.1%}, "
              f"goodput {point['goodput_rps']:.2f} req/s", file=sys.stderr)
        return point

    if rates is not None:
        for rate in rates:
            measure(rate)
    else:
        good, bad, rate = 0.0, None, args.rate or 1.0
        for _ in range(8):  # double until the target is missed
            if measure(rate)["slo_attainment"] >= args.target:
                good, rate = rate, rate * 2
            else:
                bad = rate
                break
        while bad is not None and len(points) < 12:  # then bisect
            mid = (good + bad) / 2
            if measure(mid)["slo_attainment"] >= args.target:
                good = mid
            else:
                bad = mid
    points.sort(key=lambda p: p["rate"])
    out.mkdir(parents=True, exist_ok=True)
    config = {"url": args.url, "model": cfg.model, "target": args.target, "label": args.label,
              "workload": _spec_json(spec)}
    (out / "report.json").write_text(json.dumps({"config": config, "sweep": points,
                                                 "capacity_rps": capacity(points, args.target)}, indent=1))
    rows = "\n".join(f"| {p['rate']:g} | {p['goodput_rps']:.2f} | {p['slo_attainment']:.1%} |" for p in points)
    (out / "report.md").write_text(f"# loadgen sweep: {args.url}\n\ncapacity at {args.target:.0%} attainment: "
                                   f"{capacity(points, args.target)} req/s\n\n| rate | goodput | attainment |\n"
                                   f"| --- | --- | --- |\n{rows}\n")
    plot_goodput(out / "goodput_vs_rate.png", {args.label or "run": points}, args.target)
    return points


def _spec_json(spec: WorkloadSpec) -> dict[str, Any]:
    d = asdict(spec)
    for key in ("input_len", "output_len"):
        d[key] = {k: v for k, v in d[key].items() if k != "values"}
    return d


if __name__ == "__main__":
    sys.exit(main())
