"""Reports of a run or a sweep: report.json, report.md and PNG plots readable at a glance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadgen.metrics import RequestRecord  # noqa: E402


def write_run_report(out: Path, config: dict[str, Any], summary: dict[str, Any],
                     records: list[RequestRecord]) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    slo_ttft, slo_tpot = summary["slo"]["ttft_ms"], summary["slo"]["tpot_ms"]
    doc = {"config": config, "summary": summary, "requests": [r.to_json(slo_ttft, slo_tpot) for r in records]}
    (out / "report.json").write_text(json.dumps(doc, indent=1))
    (out / "report.md").write_text(run_markdown(config, summary))
    runs = {config.get("label") or "run": records}
    files = [out / "report.json", out / "report.md",
             plot_cdf(out / "ttft_cdf.png", runs, "ttft_ms", "TTFT (ms)", slo_ttft),
             plot_cdf(out / "tpot_cdf.png", runs, "tpot_ms", "TPOT (ms)", slo_tpot),
             plot_over_time(out / "latency_over_time.png", records)]
    return files


def _sampling_text(sampling: dict[str, Any] | None) -> str:
    if not sampling:
        return "not recorded"
    if not sampling.get("temperature"):
        return "greedy (temperature 0)"
    top_p = sampling.get("top_p")
    return f"temperature {sampling['temperature']:g}" + ("" if top_p is None else f", top_p {top_p:g}")


def run_markdown(config: dict[str, Any], s: dict[str, Any]) -> str:
    lines = [f"# loadgen run: {config.get('url')} ({config.get('model')})", "",
             f"- requests: {s['num_requests']} ({s['num_ok']} ok, {s['num_errors']} errors: "
             f"{s['errors_by_kind'] or 'none'})",
             f"- duration: {s['duration_s']:.1f} s; offered rate: {config.get('rate') or 'closed loop'}"
             f"{'' if config.get('rate') else ', concurrency ' + str(config.get('concurrency'))}",
             f"- sampling: {_sampling_text(config.get('sampling'))}",
             f"- SLO: TTFT <= {s['slo']['ttft_ms']} ms, TPOT <= {s['slo']['tpot_ms']} ms; "
             f"attainment **{s['slo_attainment']:.1%}**, goodput **{s['goodput_rps']:.2f} req/s**",
             f"- throughput: {s['output_tokens_per_s']:.1f} output tok/s, {s['input_tokens_per_s']:.1f} input tok/s",
             "", "| metric (ms) | mean | p50 | p90 | p95 | p99 |", "| --- | --- | --- | --- | --- | --- |"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = s[key]
        cells = ["-" if d[k] is None else f"{d[k]:.1f}" for k in ("mean", "p50", "p90", "p95", "p99")]
        lines.append(f"| {key[:-3].upper()} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_cdf(path: Path, runs: dict[str, list[RequestRecord]], attr: str, label: str, slo: float | None) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, records in runs.items():
        values = np.sort([v for r in records if (v := getattr(r, attr)) is not None])
        if len(values):
            ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=name)
    if slo is not None:
        ax.axvline(slo, color="red", linestyle="--", label=f"SLO {slo:g} ms")
    ax.set_xlabel(label)
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{label.split()[0]} distribution")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="lower right")
    return _save(fig, path)


def plot_over_time(path: Path, records: list[RequestRecord]) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ok = [r for r in records if r.ok]
    arrivals = [r.arrival_s for r in ok]
    ax.scatter(arrivals, [r.ttft_ms or 0.0 for r in ok], s=8, label="TTFT")
    ax.scatter(arrivals, [r.e2e_ms or 0.0 for r in ok], s=8, label="E2E", alpha=0.6)
    bad = [r for r in records if not r.ok]
    if bad:
        ax.scatter([r.arrival_s for r in bad], [0] * len(bad), marker="x", color="red", label="error")
    ax.set_xlabel("arrival (s since start)")
    ax.set_ylabel("latency (ms)")
    ax.set_title("Latency over the run")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left")
    return _save(fig, path)


def plot_goodput(path: Path, sweeps: dict[str, list[dict[str, Any]]], target: float) -> Path:
    """Goodput and attainment against offered rate; the knee (highest rate meeting the target) marked."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, points in sweeps.items():
        rates = [p["rate"] for p in points]
        line = ax1.plot(rates, [p["goodput_rps"] for p in points], marker="o", label=name)[0]
        ax2.plot(rates, [p["slo_attainment"] for p in points], marker="o", color=line.get_color(), label=name)
        knee = capacity(points, target)
        if knee is not None:
            ax1.axvline(knee, color=line.get_color(), linestyle=":", label=f"{name} capacity {knee:g} req/s")
    top = max((p["rate"] for points in sweeps.values() for p in points), default=1.0)
    ax1.plot([0, top], [0, top], color="grey", linewidth=0.8, label="ideal (goodput = rate)")
    ax1.set_xlabel("offered rate (req/s)")
    ax1.set_ylabel("goodput (req/s)")
    ax1.set_title("Goodput")
    ax2.axhline(target, color="red", linestyle="--", label=f"target {target:.0%}")
    ax2.set_xlabel("offered rate (req/s)")
    ax2.set_ylabel("SLO attainment")
    ax2.set_ylim(0, 1.02)
    ax2.set_title("SLO attainment")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return _save(fig, path)


def capacity(points: list[dict[str, Any]], target: float) -> float | None:
    """Highest offered rate whose attainment stays >= target (DistServe's capacity)."""
    good = [p["rate"] for p in points if p["slo_attainment"] >= target]
    return max(good) if good else None


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def load_run(directory: Path) -> tuple[dict[str, Any], list[RequestRecord]]:
    doc = json.loads((directory / "report.json").read_text())
    fields = RequestRecord.__dataclass_fields__
    records = [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in doc.get("requests", [])]
    return doc, records


def compare(dirs: list[Path], out: Path) -> list[Path]:
    """Several runs (or sweeps) drawn on the same plots."""
    out.mkdir(parents=True, exist_ok=True)
    runs, sweeps, slo = {}, {}, {"ttft_ms": None, "tpot_ms": None}
    target = 0.9
    for d in dirs:
        doc, records = load_run(d)
        name = doc["config"].get("label") or d.name
        if "sweep" in doc:
            sweeps[name] = doc["sweep"]
            target = doc["config"].get("target", target)
        else:
            runs[name] = records
            slo = doc["summary"]["slo"]
    files = []
    if runs:
        files += [plot_cdf(out / "ttft_cdf.png", runs, "ttft_ms", "TTFT (ms)", slo["ttft_ms"]),
                  plot_cdf(out / "tpot_cdf.png", runs, "tpot_ms", "TPOT (ms)", slo["tpot_ms"])]
    if sweeps:
        files.append(plot_goodput(out / "goodput_vs_rate.png", sweeps, target))
    return files
