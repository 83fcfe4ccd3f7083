"""Per-request records and the serving metrics computed from them.

Definitions (times from the request's scheduled arrival, so queueing in the client counts too):
    TTFT = first token - arrival          E2E = last token - arrival
    TPOT = (E2E - TTFT) / (output tokens - 1)     ITL = every gap between consecutive tokens, pooled
    SLO attainment = share of requests that succeeded and met every SLO
    goodput = requests meeting every SLO per second of the run
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 95, 99)


@dataclass
class RequestRecord:
    index: int
    arrival_s: float  # scheduled arrival, seconds from the run's start
    send_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # one per streamed chunk with content
    input_tokens: int = 0
    output_tokens: int = 0  # from the server's usage when given, else the number of chunks
    status: int | None = None
    error: str | None = None  # kind-prefixed: "connect: ...", "http 503: ...", "timeout", "cancelled"
    end_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and bool(self.token_times_s)

    @property
    def error_kind(self) -> str | None:
        return None if self.error is None else self.error.split(":")[0]

    @property
    def ttft_ms(self) -> float | None:
        return (self.token_times_s[0] - self.arrival_s) * 1e3 if self.ok else None

    @property
    def e2e_ms(self) -> float | None:
        return (self.token_times_s[-1] - self.arrival_s) * 1e3 if self.ok else None

    @property
    def tpot_ms(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        assert self.e2e_ms is not None and self.ttft_ms is not None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    @property
    def itls_ms(self) -> list[float]:
        t = self.token_times_s
        return [(b - a) * 1e3 for a, b in zip(t, t[1:], strict=False)] if self.ok else []

    def meets_slo(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
        if not self.ok:
            return False
        if slo_ttft_ms is not None and (self.ttft_ms or 0.0) > slo_ttft_ms:
            return False
        tpot = self.tpot_ms
        return not (slo_tpot_ms is not None and tpot is not None and tpot > slo_tpot_ms)

    def to_json(self, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict[str, Any]:
        out = asdict(self)
        out |= {"ok": self.ok, "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2e_ms": self.e2e_ms,
                "meets_slo": self.meets_slo(slo_ttft_ms, slo_tpot_ms)}
        return out


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean and percentiles (linear interpolation, numpy's default) of ``values``."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_ms: float | None,
              slo_tpot_ms: float | None) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    meeting = sum(r.meets_slo(slo_ttft_ms, slo_tpot_ms) for r in records)
    duration_s = max(duration_s, 1e-9)
    return {
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_errors": len(records) - len(ok),
        "errors_by_kind": dict(Counter(r.error_kind or "empty" for r in records if not r.ok)),
        "duration_s": duration_s,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_ms) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itls_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "slo_attainment": meeting / len(records) if records else 0.0,
        "goodput_rps": meeting / duration_s,
        "request_throughput_rps": len(ok) / duration_s,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / duration_s,
        "input_tokens_per_s": sum(r.input_tokens for r in ok) / duration_s,
    }
