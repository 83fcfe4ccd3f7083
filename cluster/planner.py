"""The fewest workers that meet the SLO at a rate: ``tandem plan``'s search over the cluster simulation.

    plan = find_plan(profile, spec, slo, attainment=0.9, max_workers=24)
    plan.prefill, plan.decode, plan.attainment, plan.goodput_rps

Worker counts are tried by total, smallest first (at each total every split, local prefill, i.e. no
prefill workers, among them); the first total with a split that meets the attainment wins, and among
its splits the one with the highest attainment. A total the analytic model finds hopeless is skipped
without simulating it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.capacity_model import CapacityModel, Load
from cluster.cluster_sim import SimSpec, simulate
from router.slo_window import SLOTargets
from workers.protocol.timing_profile import TimingProfile


@dataclass(frozen=True)
class Plan:
    prefill: int
    decode: int
    attainment: float
    goodput_rps: float
    ttft_p50_s: float
    simulated: int  # splits simulated to find it


def find_plan(profile: TimingProfile, spec: SimSpec, slo: SLOTargets, attainment: float = 0.9,
              max_workers: int = 24, max_prefill: int | None = None) -> Plan | None:
    """None when no split of up to ``max_workers`` meets the attainment."""
    model = CapacityModel(profile, slo, attainment)
    load = Load(spec.rate, spec.input_len, spec.output_len)
    simulated = 0
    for total in range(1, max_workers + 1):
        best: Plan | None = None
        for prefill in range(0, min(total - 1, max_prefill if max_prefill is not None else total) + 1):
            decode = total - prefill
            if not model.meets(load, prefill, decode, margin=3.0):  # far beyond the SLO: not worth a run
                continue
            result = simulate(profile, spec, prefill, decode)
            simulated += 1
            share = result.attainment(slo)
            if share >= attainment and (best is None or share > best.attainment):
                ttfts = sorted(result.ttfts())
                best = Plan(prefill, decode, share, result.goodput(slo), ttfts[len(ttfts) // 2] if ttfts else 0.0,
                            simulated)
        if best is not None:
            return best
    return None


def predict(profile: TimingProfile, spec: SimSpec, slo: SLOTargets, prefill: int, decode: int) -> Plan:
    """The simulation's figures for one given split."""
    result = simulate(profile, spec, prefill, decode)
    ttfts = sorted(result.ttfts())
    return Plan(prefill, decode, result.attainment(slo), result.goodput(slo),
                ttfts[len(ttfts) // 2] if ttfts else 0.0, 1)
