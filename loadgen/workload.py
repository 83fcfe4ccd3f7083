"""Seeded, reproducible workloads: when requests arrive and what they ask.

Length specs (``--input-len`` / ``--output-len``): ``128``, ``uniform:64:256``, ``lognormal:200:60``
(mean, sd), or ``jsonl:FILE:FIELD`` (one number per line under FIELD, cycled).
Arrivals: ``poisson`` (exponential gaps), ``gamma`` (burstiness by coefficient of variation: cv 1
is Poisson, larger is burstier), ``constant``; or closed-loop concurrency (no schedule).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadgen.tokens import TokenText


@dataclass(frozen=True)
class LengthSpec:
    kind: str
    a: float = 0.0
    b: float = 0.0
    values: tuple[int, ...] = ()

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            if parts[0] in ("uniform", "lognormal") and len(parts) == 3:
                spec = cls(parts[0], float(parts[1]), float(parts[2]))
                if spec.kind == "uniform" and spec.a > spec.b:
                    raise ValueError("low > high")
                return spec
            if parts[0] == "jsonl" and len(parts) == 3:
                lines = Path(parts[1]).read_text().splitlines()
                values = tuple(int(json.loads(line)[parts[2]]) for line in lines if line.strip())
                if not values:
                    raise ValueError("no values")
                return cls("jsonl", values=values)
        except (ValueError, KeyError, OSError) as e:
            raise ValueError(f"bad length spec {text!r}: {e}") from e
        raise ValueError(f"bad length spec {text!r}: use N, uniform:LO:HI, lognormal:MEAN:SD or jsonl:FILE:FIELD")

    def sample(self, rng: random.Random, index: int) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "lognormal":
            # parameters of the underlying normal that give this mean and sd
            sigma2 = math.log(1 + (self.b / self.a) ** 2)
            value = rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))
        else:
            value = self.values[index % len(self.values)]
        return max(1, round(value))


def arrival_times(kind: str, rate: float, count: int, rng: random.Random, cv: float = 1.0) -> list[float]:
    """Arrival offsets in seconds for ``count`` requests at ``rate`` per second."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    if kind == "constant":
        return [i / rate for i in range(count)]
    if kind == "poisson":
        gaps = [rng.expovariate(rate) for _ in range(count)]
    elif kind == "gamma":
        shape = 1.0 / (cv * cv)
        gaps = [rng.gammavariate(shape, 1.0 / (rate * shape)) for _ in range(count)]
    else:
        raise ValueError(f"unknown arrival process {kind!r}: poisson, gamma or constant")
    times, t = [], 0.0
    for g in gaps:
        t += g
        times.append(t)
    return times


@dataclass
class PlannedRequest:
    """One conversation: a single request, or several turns sent one after another."""

    index: int
    arrival_s: float | None  # None in closed-loop mode
    system: str | None  # shared-prefix system prompt
    turns: list[str]  # user messages; turn t is sent with the history of turns < t
    max_tokens: int | None  # None: an open-ended chat, sent without max_tokens (ends at EOS or the model's length)
    input_tokens: int  # tokens of the first turn's text (system + user), by the target tokenizer
    group: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    input_len: LengthSpec
    output_len: LengthSpec
    arrival: str = "poisson"
    rate: float | None = None  # None: closed loop
    cv: float = 1.0
    prefix_groups: int = 0
    prefix_len: int = 512
    turns: int = 1
    seed: int = 0
    open_ended: float = 0.0  # share of requests sent without max_tokens, as chat users do

    def __post_init__(self) -> None:
        if not 0.0 <= self.open_ended <= 1.0:
            raise ValueError(f"the open-ended share must be in [0, 1], got {self.open_ended}")


def build_workload(spec: WorkloadSpec, text: TokenText) -> list[PlannedRequest]:
    """The same spec and seed always give the same schedule and prompts."""
    rng = random.Random(spec.seed)
    arrivals: list[float | None] = (
        list(arrival_times(spec.arrival, spec.rate, spec.num_requests, rng, spec.cv))
        if spec.rate else [None] * spec.num_requests)
    prefixes = [text.exact(spec.prefix_len, rng) for _ in range(spec.prefix_groups)]
    # Its own generator: adding open-ended requests leaves every other draw of a seeded workload as it was.
    open_rng = random.Random(f"{spec.seed}:open-ended")
    out = []
    for i in range(spec.num_requests):
        group = i % spec.prefix_groups if spec.prefix_groups else None
        system = prefixes[group] if group is not None else None
        in_len = spec.input_len.sample(rng, i)
        turns = [text.exact(in_len if t == 0 else max(1, in_len // 4), rng) for t in range(spec.turns)]
        out_len = spec.output_len.sample(rng, i)
        out.append(PlannedRequest(
            index=i, arrival_s=arrivals[i], system=system, turns=turns,
            max_tokens=None if open_rng.random() < spec.open_ended else out_len,
            input_tokens=in_len + (spec.prefix_len if system is not None else 0), group=group))
    return out
