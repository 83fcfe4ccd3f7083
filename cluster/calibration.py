"""Fits the cluster simulation to a measured run: ``tandem plan --calibrate REPORT``.

    run = load_run("runs/low/report.json")      # a tandem loadgen report
    prompt_scale, decode_scale = fit_scales(profile, run, prefill=0, decode=1)

A profile times the engine alone. Served, the same steps take longer: on a small CPU machine the router, Ray
and the client share the engine's cores (fitted through `tandem serve` on 2 cores: prompt time x1.02, decode
time x1.20, bench_plan_accuracy.py), on a GPU the host's work per step adds up. The fit replays the run's own requests
(arrival, prompt and output tokens) through the simulation and finds the two scales of profiled time, prompt
work and decode steps, at which the simulated TTFT and TPOT medians equal the measured ones. Those are the
autoscaler's correction factors (observed / profiled), learned from one run at a rate the cluster serves,
and they let the simulation predict other rates on the same machine and cluster shape.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cluster.cluster_sim import SimSpec, simulate
from workers.protocol.timing_profile import TimingProfile

SCALE_BOUNDS = (0.25, 8.0)
_BISECTIONS = 14  # the bounds' ratio of 32 halved 14 times: within 0.03% of the scale
_ROUNDS = 3  # prompt and decode scales fitted in turn (each moves the other's median a little)


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class MeasuredRun:
    trace: list[tuple[float, int, int]]  # every request's (arrival s, prompt tokens, output tokens)
    ttft_p50_s: float
    tpot_p50_s: float


def load_run(path: str | Path) -> MeasuredRun:
    """A ``tandem loadgen`` report.json: the requests it sent and the TTFT / TPOT medians it measured."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
        requests = report["requests"]
        trace = [(float(r["arrival_s"]), int(r["input_tokens"]), max(1, int(r["output_tokens"] or 1)))
                 for r in requests]
        served = [r for r in requests if r["ok"] and r["tpot_ms"] is not None and r["ttft_ms"] is not None]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"{path}: not a tandem loadgen report ({e})") from e
    if len(served) < 5:
        raise CalibrationError(f"{path}: {len(served)} requests with a TTFT and TPOT; a fit needs at least 5")
    return MeasuredRun(trace, statistics.median(r["ttft_ms"] for r in served) / 1000,
                       statistics.median(r["tpot_ms"] for r in served) / 1000)


def simulated_medians(profile: TimingProfile, run: MeasuredRun, prefill: int, decode: int,
                      prompt_scale: float, decode_scale: float) -> tuple[float, float]:
    """TTFT and TPOT medians (s) of the run's requests replayed through the simulation at these scales."""
    spec = SimSpec(rate=1.0, input_len=1, output_len=1, prefill_scale=prompt_scale, decode_scale=decode_scale)
    result = simulate(profile, spec, prefill, decode, trace=run.trace)
    ttfts, tpots = result.ttfts(), result.tpots()
    return statistics.median(ttfts) if ttfts else math.inf, statistics.median(tpots) if tpots else 0.0


def fit_scales(profile: TimingProfile, run: MeasuredRun, prefill: int, decode: int) -> tuple[float, float]:
    """(prompt scale, decode scale) at which the replayed run's TTFT and TPOT medians match the measured ones,
    each within SCALE_BOUNDS (a bound means the measurement lies beyond what the profile can be scaled to)."""
    def tpot_at(prompt_scale: float) -> Callable[[float], float]:
        return lambda s: simulated_medians(profile, run, prefill, decode, prompt_scale, s)[1]

    def ttft_at(decode_scale: float) -> Callable[[float], float]:
        return lambda s: simulated_medians(profile, run, prefill, decode, s, decode_scale)[0]

    prompt_scale = decode_scale = 1.0
    for _ in range(_ROUNDS):
        decode_scale = _solve(tpot_at(prompt_scale), run.tpot_p50_s)
        prompt_scale = _solve(ttft_at(decode_scale), run.ttft_p50_s)
    return prompt_scale, decode_scale


def _solve(median_at: Callable[[float], float], target: float) -> float:
    """The scale whose simulated median reaches ``target`` (bisection in log space: medians grow with it)."""
    lo, hi = math.log(SCALE_BOUNDS[0]), math.log(SCALE_BOUNDS[1])
    for _ in range(_BISECTIONS):
        mid = (lo + hi) / 2
        if median_at(math.exp(mid)) < target:
            lo = mid
        else:
            hi = mid
    return round(math.exp((lo + hi) / 2), 3)
