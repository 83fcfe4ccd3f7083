"""SLO attainment and goodput over a sliding window: what the autoscaler and ``/cluster/status`` read.

    window = SLOWindow(SLOTargets(ttft_s=2.0, tpot_s=0.1), window_s=60)
    window.arrived(prompt_tokens=300)                      # when a request comes in
    window.finished(ttft_s=0.8, tpot_s=0.03, output_tokens=64, ok=True)   # when it ends, however it ends
    window.counts()   # plain sums over the window: several routers' counts add up (``SLOCounts.merge``)
    window.totals()   # the same sums since the router started (the autoscaler differences them per interval)

A request meets the SLO when it ended without error, its TTFT is within ``ttft_s`` and its TPOT
(E2E - TTFT) / (output tokens - 1) within ``tpot_s``. Refused and failed requests count against
attainment. Goodput is requests/s that met the SLO.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, fields, replace
from typing import NamedTuple


class SLOTargets(NamedTuple):
    ttft_s: float
    tpot_s: float


@dataclass(frozen=True)
class SLOCounts:
    """Sums over one window (of one router, or merged over several): each field adds up across routers."""

    span_s: float  # how long the window has been filling (up to window_s); the largest when merged
    arrived: int = 0
    arrived_prompt_tokens: int = 0
    finished: int = 0
    met: int = 0
    output_tokens: int = 0
    ttft_sum_s: float = 0.0  # over requests that got a first token
    ttft_count: int = 0
    tpot_sum_s: float = 0.0  # over requests with two or more output tokens
    tpot_count: int = 0
    queue_sum_s: float = 0.0  # workers' admission waits, over requests that got a first token

    @staticmethod
    def merge(parts: Iterable[SLOCounts]) -> SLOCounts:
        parts = list(parts)
        if not parts:
            return SLOCounts(0.0)
        sums = {f.name: sum(getattr(p, f.name) for p in parts) for f in fields(SLOCounts) if f.name != "span_s"}
        return SLOCounts(max(p.span_s for p in parts), **sums)

    # ---- what the counts mean ----
    def rate(self, count: float) -> float:
        return count / self.span_s if self.span_s > 0 else 0.0

    @property
    def attainment(self) -> float | None:
        """Share of finished requests that met the SLO; None before any finished."""
        return self.met / self.finished if self.finished else None

    @property
    def goodput_rps(self) -> float:
        return self.rate(self.met)

    @property
    def mean_ttft_s(self) -> float | None:
        return self.ttft_sum_s / self.ttft_count if self.ttft_count else None

    @property
    def mean_tpot_s(self) -> float | None:
        return self.tpot_sum_s / self.tpot_count if self.tpot_count else None

    @property
    def mean_queue_s(self) -> float | None:
        return self.queue_sum_s / self.ttft_count if self.ttft_count else None

    def summary(self) -> dict[str, float | int | None]:
        """The figures an operator reads (``/cluster/status``'s ``slo``)."""
        return {"window_s": round(self.span_s, 1), "arrival_rps": round(self.rate(self.arrived), 3),
                "prompt_tokens_per_s": round(self.rate(self.arrived_prompt_tokens), 1),
                "output_tokens_per_s": round(self.rate(self.output_tokens), 1),
                "finished": self.finished, "met": self.met,
                "attainment": None if self.attainment is None else round(self.attainment, 4),
                "goodput_rps": round(self.goodput_rps, 3),
                "mean_ttft_ms": _ms(self.mean_ttft_s), "mean_tpot_ms": _ms(self.mean_tpot_s),
                "mean_queue_ms": _ms(self.mean_queue_s)}


@dataclass
class RequestTrace:
    """One request's times as its router sees them (``time.perf_counter``), recorded once it ends."""

    arrival: float
    prompt_tokens: int | None = None  # set once the request is valid: a bad request is no SLO's business
    first_token_at: float | None = None
    queue_s: float = 0.0  # the decode worker's admission wait, from its first chunk
    output_tokens: int = 0  # the longest choice's (TPOT is per sequence)
    ok: bool = False  # ended as asked (a finish reason, no error, the client still there)


class _Finished(NamedTuple):
    at: float
    ttft_s: float | None
    tpot_s: float | None
    queue_s: float
    output_tokens: int
    met: bool


class SLOWindow:
    def __init__(self, targets: SLOTargets, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.targets = targets
        self.window_s = window_s
        self._clock = clock
        self._started = clock()
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, prompt tokens)
        self._finished: deque[_Finished] = deque()
        self._total = SLOCounts(0.0)

    def arrived(self, prompt_tokens: int) -> None:
        self._arrivals.append((self._clock(), prompt_tokens))
        self._total = replace(self._total, arrived=self._total.arrived + 1,
                              arrived_prompt_tokens=self._total.arrived_prompt_tokens + prompt_tokens)

    def finished(self, *, ttft_s: float | None, tpot_s: float | None, output_tokens: int, ok: bool,
                 queue_s: float = 0.0) -> bool:
        """Record one request's end (``ttft_s`` None: it never got a first token); returns whether it met."""
        met = (ok and ttft_s is not None and ttft_s <= self.targets.ttft_s
               and (tpot_s is None or tpot_s <= self.targets.tpot_s))
        self._finished.append(_Finished(self._clock(), ttft_s, tpot_s, queue_s, output_tokens, met))
        t = self._total
        self._total = replace(
            t, finished=t.finished + 1, met=t.met + met, output_tokens=t.output_tokens + output_tokens,
            ttft_sum_s=t.ttft_sum_s + (ttft_s or 0.0), ttft_count=t.ttft_count + (ttft_s is not None),
            tpot_sum_s=t.tpot_sum_s + (tpot_s or 0.0), tpot_count=t.tpot_count + (tpot_s is not None),
            queue_sum_s=t.queue_sum_s + (queue_s if ttft_s is not None else 0.0))
        return met

    def totals(self) -> SLOCounts:
        """Every request since this window started (``span_s``: the seconds since then)."""
        return replace(self._total, span_s=self._clock() - self._started)

    def record(self, trace: RequestTrace, ended_at: float) -> tuple[float | None, bool]:
        """A valid request's end; returns its TPOT (None under two tokens) and whether it met the SLO."""
        if trace.prompt_tokens is None:
            return None, False
        ttft = None if trace.first_token_at is None else trace.first_token_at - trace.arrival
        tpot = None if ttft is None else tpot_seconds(ttft, ended_at - trace.arrival, trace.output_tokens)
        return tpot, self.finished(ttft_s=ttft, tpot_s=tpot, output_tokens=trace.output_tokens, ok=trace.ok,
                                   queue_s=trace.queue_s)

    def counts(self) -> SLOCounts:
        now = self._clock()
        self._expire(now)
        got_first = [f for f in self._finished if f.ttft_s is not None]
        with_tpot = [f.tpot_s for f in self._finished if f.tpot_s is not None]
        return SLOCounts(
            span_s=min(self.window_s, now - self._started), arrived=len(self._arrivals),
            arrived_prompt_tokens=sum(n for _, n in self._arrivals), finished=len(self._finished),
            met=sum(f.met for f in self._finished), output_tokens=sum(f.output_tokens for f in self._finished),
            ttft_sum_s=sum(f.ttft_s for f in got_first if f.ttft_s is not None), ttft_count=len(got_first),
            tpot_sum_s=sum(with_tpot), tpot_count=len(with_tpot), queue_sum_s=sum(f.queue_s for f in got_first))

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_s
        while self._arrivals and self._arrivals[0][0] < cutoff:
            self._arrivals.popleft()
        while self._finished and self._finished[0].at < cutoff:
            self._finished.popleft()


def tpot_seconds(ttft_s: float, e2e_s: float, output_tokens: int) -> float | None:
    """(E2E - TTFT) / (output tokens - 1); None for fewer than two tokens (no gap to measure)."""
    return (e2e_s - ttft_s) / (output_tokens - 1) if output_tokens > 1 else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
