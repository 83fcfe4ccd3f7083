"""How many prefill and decode workers a load needs to meet the SLO, from a timing profile: the
autoscaler's prediction (closed-form queueing, microseconds per call).

    model = CapacityModel(profile, SLOTargets(ttft_s=2.0, tpot_s=0.1), attainment=0.9)
    load = Load(rate=4.0, prompt_tokens=300, output_tokens=64)
    model.ttft_s(load, prefill_workers=2, decode_workers=3)   # at the attainment quantile, queue included
    model.tpot_s(load, prefill_workers=2, decode_workers=3)

- A prompt's service time is its chunks' prefill steps; prefill workers are an M/M/c queue (Erlang C),
  and TTFT is the ``attainment`` quantile of its wait, plus the service, the KV transfer and a decode step.
- A decode worker's batch B solves Little's law B = (rate / workers) x output tokens x step(B): more
  load, bigger batches, slower steps. TPOT is step(B); without prefill workers, the decode workers also
  run every prompt, and those seconds come out of their decoding time.
A load no worker count can carry (the batch outgrows max_num_seqs or the KV pool) is infinite.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from router.slo_window import SLOTargets
from workers.protocol.timing_profile import TimingProfile

INFEASIBLE = math.inf


class Load(NamedTuple):
    rate: float  # requests per second
    prompt_tokens: float  # mean, uncached
    output_tokens: float  # mean


class CapacityModel:
    def __init__(self, profile: TimingProfile, slo: SLOTargets, attainment: float = 0.9,
                 prefill_chunk_size: int | None = None):
        self.profile = profile
        self.slo = slo
        self.attainment = attainment
        self.chunk = prefill_chunk_size or profile.prefill_chunk_size

    # ---- service times ----
    def prefill_service_s(self, prompt_tokens: float) -> float:
        """One prompt alone on a worker: its chunks, each after the ones before it."""
        n = max(1, round(prompt_tokens))
        chunk = self.chunk or n
        return sum(self.profile.prefill_s(min(chunk, n - done), done) for done in range(0, n, chunk))

    def decode_batch(self, load: Load, decode_workers: int, busy_share: float = 0.0) -> float:
        """Requests decoding at once on each decode worker (``busy_share``: the share of its time spent on
        prompts); INFEASIBLE when the batch would outgrow the worker."""
        if load.rate <= 0:
            return 0.0
        context = load.prompt_tokens + load.output_tokens / 2
        per_worker = load.rate / decode_workers * max(load.output_tokens - 1, 1)
        limit = min(self.profile.max_num_seqs,
                    self.profile.kv_tokens_per_worker / max(1.0, load.prompt_tokens + load.output_tokens))
        batch = 1.0
        for _ in range(100):  # the fixed point of B = per_worker * step(B); step grows slowly with B
            new = per_worker * self.profile.decode_step_s(max(1, math.ceil(batch)), context) / (1 - busy_share)
            if new > limit:
                return INFEASIBLE
            if abs(new - batch) < 1e-3:
                return new
            batch = new
        return batch

    # ---- predictions ----
    def tpot_s(self, load: Load, prefill_workers: int, decode_workers: int) -> float:
        if decode_workers <= 0:
            return INFEASIBLE
        busy = self._prompt_share(load, prefill_workers, decode_workers)
        if busy >= 1:
            return INFEASIBLE
        batch = self.decode_batch(load, decode_workers, busy)
        if batch == INFEASIBLE:
            return INFEASIBLE
        context = load.prompt_tokens + load.output_tokens / 2
        return self.profile.decode_step_s(max(1, math.ceil(batch)), context) / (1 - busy)

    def ttft_s(self, load: Load, prefill_workers: int, decode_workers: int) -> float:
        if decode_workers <= 0:
            return INFEASIBLE
        service = self.prefill_service_s(load.prompt_tokens)
        tpot = self.tpot_s(load, prefill_workers, decode_workers)
        if tpot == INFEASIBLE:
            return INFEASIBLE
        if prefill_workers > 0:
            wait = self._wait_quantile(load.rate, service, prefill_workers)
            transfer = self.profile.transfer_tokens_s(round(load.prompt_tokens))
            return wait + service + transfer + tpot
        # Local prefill: prompts queue on the decode workers, whose steps also carry the running batch.
        wait = self._wait_quantile(load.rate, service + tpot, decode_workers)
        return wait + service + tpot

    def meets(self, load: Load, prefill_workers: int, decode_workers: int, margin: float = 1.0,
              corrections: tuple[float, float] = (1.0, 1.0)) -> bool:
        """Whether the SLO holds with ``margin`` to spare (0.8: predicted within 80% of each target)."""
        ttft = self.ttft_s(load, prefill_workers, decode_workers) * corrections[0]
        tpot = self.tpot_s(load, prefill_workers, decode_workers) * corrections[1]
        return ttft <= self.slo.ttft_s * margin and tpot <= self.slo.tpot_s * margin

    def _prompt_share(self, load: Load, prefill_workers: int, decode_workers: int) -> float:
        """Share of a decode worker's time spent computing prompts (none with prefill workers)."""
        if prefill_workers > 0:
            return 0.0
        return load.rate / decode_workers * self.prefill_service_s(load.prompt_tokens)

    def _wait_quantile(self, rate: float, service_s: float, servers: int) -> float:
        """The ``attainment`` quantile of the wait in an M/M/c queue (c = ``servers``)."""
        if rate <= 0:
            return 0.0
        offered = rate * service_s
        if offered >= servers:
            return INFEASIBLE
        waits = erlang_c(servers, offered)
        miss = 1 - self.attainment
        if waits <= miss:
            return 0.0
        return math.log(waits / miss) / (servers / service_s - rate)


def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``offered`` = rate x service (< servers)."""
    term, total = 1.0, 1.0
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)
    return last / (total + last)
