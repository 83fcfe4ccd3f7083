"""The goodput-SLO autoscaler: each interval, from what the routers observed, the pool sizes the SLO needs.

    scaler = Autoscaler(model, AutoscalerSettings(interval_s=15, scale_down_delay_s=120))
    decisions = scaler.decide(observation, targets)     # [Decision(role, from, to, reason), ...]

- **Predict.** The arrival rate and mean prompt and output lengths of the last few intervals
  (``Observation``), plus the requests already waiting (to be cleared within ``backlog_horizon_s``), go
  through the ``CapacityModel``; the
  fewest workers whose predicted TTFT and TPOT stay within ``up_margin`` of the SLO are what is needed
  (where no size meets, the fewest past which more workers predict no shorter latencies).
- **Correct.** Each steady interval (enough finished requests, the pools at their targets for two
  intervals, no backlog: other latencies belong to no size), observed / predicted mean TTFT and TPOT
  update two correction factors (smoothed, within [0.5, 4]): what the profile misses (router and Ray
  overhead, another machine) is learned instead of assumed.
- **Scale up fast, down slowly.** A pool grows as soon as it needs to, by as much as it needs, and also
  by one when attainment is below target while requests wait (the model was wrong); that step then holds
  while the arrival rate stays above 80% of the rate that needed it. It shrinks only when
  ``scale_down_delay_s`` has passed since its last change and every interval of the last
  ``scale_down_delay_s`` needed fewer workers (at the stricter ``down_margin``), to the most any of them
  needed, and never while the interval misses the attainment target; workers leave by draining.
  What a shrink plans for is not the measured arrival rate but the highest rate its count allows (two
  standard deviations of a Poisson count above it): at 4 req/s a 6 s window counts 14 to 34 arrivals, and
  a pool shrunk on a low count grows back on the next high one.
  A steady load therefore never flaps: a shrink needs a whole quiet delay, and it never goes below
  what any interval of that delay needed at the top of its rate's noise.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cluster.capacity_model import CapacityModel, Load
from router.slo_window import SLOCounts
from workers.protocol.cluster_keys import ROLES, PoolTarget

MIN_SAMPLES = 5  # finished requests in an interval before its latencies correct the model


@dataclass(frozen=True)
class AutoscalerSettings:
    interval_s: float = 15.0
    scale_down_delay_s: float = 120.0
    attainment: float = 0.9
    up_margin: float = 0.85  # grow when a prediction passes this share of a target
    down_margin: float = 0.6  # shrink only to sizes predicted within this share
    rate_intervals: int = 3  # the arrival rate is read over this many intervals
    backlog_horizon_s: float = 20.0  # requests already waiting are planned to be cleared within this long


@dataclass(frozen=True)
class Observation:
    """One interval of the cluster, as the controller read it from Redis."""

    counts: SLOCounts  # the interval's requests (every router's totals, differenced)
    waiting: int  # requests queued on workers now
    live: dict[str, int]  # workers serving now, per role


@dataclass(frozen=True)
class Decision:
    role: str
    old: int
    new: int
    reason: str


# A reactive step's size holds until the arrival rate falls under this share of the rate that needed it.
REACTIVE_FLOOR_RATE_SHARE = 0.8
# Where no size meets the SLO, sizes predicted within 5% of the best one are as good as it.
CLOSEST_SHARE = 1.05
# A shrink plans for the arrival count plus this many of its standard deviations (sqrt(count), Poisson).
SHRINK_RATE_SIGMAS = 2.0


@dataclass
class _RoleState:
    last_change_at: float | None = None  # the first decision counts as one: a shrink waits a whole delay
    needs: deque[tuple[float, int]] = field(default_factory=deque)  # (time, workers needed), one delay's worth
    # After a reactive step (the model said enough, attainment said no): (workers, arrival rate then). The
    # pool keeps that size while the load stays near that rate, or the model would take the step back.
    reactive_floor: tuple[int, float] | None = None

    def floor(self, rate: float) -> int:
        if self.reactive_floor is not None and rate < self.reactive_floor[1] * REACTIVE_FLOOR_RATE_SHARE:
            self.reactive_floor = None  # the load that needed it has gone
        return 0 if self.reactive_floor is None else self.reactive_floor[0]

    def most_needed(self, now: float, delay_s: float) -> int:
        while self.needs and self.needs[0][0] < now - delay_s:
            self.needs.popleft()
        return max(n for _, n in self.needs)


@dataclass
class Autoscaler:
    model: CapacityModel
    settings: AutoscalerSettings
    corrections: list[float] = field(default_factory=lambda: [1.0, 1.0])  # TTFT, TPOT: observed / predicted
    last_load: Load | None = None
    last_needed: dict[str, int] = field(default_factory=dict)
    _previous_live: dict[str, int] = field(default_factory=dict)
    _recent: deque[SLOCounts] = field(default_factory=deque)
    _shrink_rate: float = 0.0  # the last load's rate at the top of its count's noise
    _roles: dict[str, _RoleState] = field(default_factory=lambda: {r: _RoleState() for r in ROLES})

    def decide(self, obs: Observation, targets: dict[str, PoolTarget], now: float) -> list[Decision]:
        load = self._load(obs)
        self.last_load = load
        current = {role: targets[role].replicas for role in ROLES}
        # Latencies say what the current sizes do only in a steady interval: the pools at their targets
        # since the one before (no worker starting or draining) and no backlog (a queue left from a smaller
        # pool inflates TTFT for a while after the pool grew).
        steady = obs.live == current and self._previous_live == current and obs.waiting == 0
        self._previous_live = dict(obs.live)
        if steady:
            self._correct(obs, load, current)
        needed = self._needed(load, targets, self.settings.up_margin)
        relaxed = self._needed(load._replace(rate=self._shrink_rate), targets, self.settings.down_margin)
        attainment = obs.counts.attainment
        missing = attainment is not None and attainment < self.settings.attainment
        lagging = missing and obs.waiting > 0
        self.last_needed = needed
        decisions = []
        for role in ROLES:
            target, state = targets[role], self._roles[role]
            if state.last_change_at is None:
                state.last_change_at = now
            have = current[role]
            if have == 0 and target.max_replicas == 0:
                continue
            want = needed[role]
            reason = (f"predicted need {want} at {self._describe(load)}; corrections TTFT x{self.corrections[0]:.2f}, "
                      f"TPOT x{self.corrections[1]:.2f}")
            if want <= have and lagging and role == self._bottleneck(load, current) and have < target.max_replicas:
                want, reason = have + 1, (f"attainment {attainment:.0%} < {self.settings.attainment:.0%} with "
                                          f"{obs.waiting} waiting (the model predicted enough)")
                state.reactive_floor = (want, load.rate)
            state.needs.append((now, max(relaxed[role], want)))
            most = max(state.most_needed(now, self.settings.scale_down_delay_s), state.floor(load.rate))
            if want > have:
                decisions.append(Decision(role, have, want, "up: " + reason))
            elif most < have and not missing and now - state.last_change_at >= self.settings.scale_down_delay_s:
                new = max(most, target.min_replicas)
                decisions.append(Decision(role, have, new, f"down: at most {new} needed for "
                                          f"{self.settings.scale_down_delay_s:.0f}s (now {self._describe(load)})"))
            else:
                continue
            state.last_change_at = now
        return decisions

    # ---- parts ----
    def _load(self, obs: Observation) -> Load:
        """The load over the last ``rate_intervals`` intervals (one interval's Poisson count is noisy: 8
        arrivals expected, 4 to 13 seen), plus the backlog to clear within ``backlog_horizon_s``."""
        self._recent.append(obs.counts)
        while len(self._recent) > self.settings.rate_intervals:
            self._recent.popleft()
        c = SLOCounts.merge(self._recent)
        span = max(sum(r.span_s for r in self._recent), 1e-9)
        backlog_rate = obs.waiting / max(self.settings.backlog_horizon_s, 2 * self.settings.interval_s)
        self._shrink_rate = (c.arrived + SHRINK_RATE_SIGMAS * (c.arrived + 1) ** 0.5) / span + backlog_rate
        prompt = c.arrived_prompt_tokens / c.arrived if c.arrived else (self.last_load.prompt_tokens
                                                                        if self.last_load else 256.0)
        output = c.output_tokens / c.finished if c.finished else (self.last_load.output_tokens
                                                                 if self.last_load else 64.0)
        return Load(c.arrived / span + backlog_rate, prompt, max(output, 1.0))

    def _needed(self, load: Load, targets: dict[str, PoolTarget], margin: float) -> dict[str, int]:
        """The fewest workers (within bounds) meeting the SLO at ``margin``; if none does, the fewest past which
        more workers would not help (``_closest``)."""
        p_bounds = range(targets["prefill"].min_replicas, targets["prefill"].max_replicas + 1)
        d_bounds = range(max(1, targets["decode"].min_replicas), targets["decode"].max_replicas + 1)
        corrections = (self.corrections[0], self.corrections[1])
        best: tuple[int, int] | None = None
        for p in p_bounds:  # for each prefill count, the fewest decode workers that meet, if any do
            d = next((d for d in d_bounds if self.model.meets(load, p, d, margin, corrections)), None)
            if d is not None and (best is None or p + d < sum(best)):
                best = (p, d)
        if best is None:
            best = self._closest(load, p_bounds, d_bounds, corrections)
        return {"prefill": best[0], "decode": best[1]}

    def _closest(self, load: Load, p_bounds: range, d_bounds: range,
                 corrections: tuple[float, float]) -> tuple[int, int]:
        """No size meets: the fewest workers within ``CLOSEST_SHARE`` of the best prediction any size gets.
        Workers past that shorten no request (an idle cluster whose learned corrections put even one
        unqueued request over the SLO needs its minimum, not its maximum); under overload that is the most."""
        def excess(p: int, d: int) -> float:  # the worse of the two predictions, in SLO units
            return max(self.model.ttft_s(load, p, d) * corrections[0] / self.model.slo.ttft_s,
                       self.model.tpot_s(load, p, d) * corrections[1] / self.model.slo.tpot_s)
        sizes = sorted(((p, d) for p in p_bounds for d in d_bounds), key=sum)
        scores = [excess(p, d) for p, d in sizes]
        least = min(scores)
        if least == float("inf"):
            return p_bounds[-1], d_bounds[-1]
        return next(size for size, score in zip(sizes, scores, strict=True) if score <= least * CLOSEST_SHARE)

    def _correct(self, obs: Observation, load: Load, current: dict[str, int]) -> None:
        c = obs.counts
        if c.ttft_count < MIN_SAMPLES or c.span_s <= 0:
            return
        observed_load = Load(c.arrived / c.span_s, load.prompt_tokens, load.output_tokens)
        p, d = current["prefill"], current["decode"]
        # The model's TTFT is a quantile; compare like with like: the observed mean against the model at 50%.
        median_model = CapacityModel(self.model.profile, self.model.slo, 0.5, self.model.chunk)
        predicted = (median_model.ttft_s(observed_load, p, d), self.model.tpot_s(observed_load, p, d))
        observed = (c.mean_ttft_s, c.mean_tpot_s)
        for i in range(2):
            seen, expected = observed[i], predicted[i]
            if seen is None or not 0 < expected < float("inf"):
                continue
            ratio = min(4.0, max(0.5, seen / expected))
            self.corrections[i] = 0.5 * self.corrections[i] + 0.5 * ratio

    def _bottleneck(self, load: Load, current: dict[str, int]) -> str:
        """The pool to add to when the model gives no answer: the one whose SLO is missed worse."""
        if current["prefill"] == 0:
            return "decode"
        ttft = self.model.ttft_s(load, current["prefill"], current["decode"]) / self.model.slo.ttft_s
        tpot = self.model.tpot_s(load, current["prefill"], current["decode"]) / self.model.slo.tpot_s
        return "prefill" if ttft >= tpot else "decode"

    @staticmethod
    def _describe(load: Load) -> str:
        return (f"{load.rate:.2f} req/s, {load.prompt_tokens:.0f} prompt and {load.output_tokens:.0f} output "
                "tokens each")
