"""Prometheus metrics of one worker (names prefixed ``tandem_``, labelled by worker and role).

Each worker keeps its own registry, so several services in one process (tests) never collide, and
the router can merge every worker's exposition into one scrape. Engine totals are read after each
step (``update``) and turned into counter increments.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from workers.engine.engine import EngineStats

_STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class WorkerMetrics:
    def __init__(self, worker_id: str, role: str):
        self.registry = CollectorRegistry()
        names = ["worker_id", "role"]
        ids = {"worker_id": worker_id, "role": role}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=self.registry).labels(**ids)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=self.registry).labels(**ids)

        self.waiting = gauge("tandem_requests_waiting", "Requests queued for admission")
        self.running = gauge("tandem_requests_running", "Requests in the running batch")
        self.awaiting_kv = gauge("tandem_requests_awaiting_kv", "Requests whose KV is being prefilled elsewhere")
        self.kv_used = gauge("tandem_kv_blocks_used", "KV blocks held by requests")
        self.kv_total = gauge("tandem_kv_blocks_total", "KV blocks in the pool")
        self.kv_usage = gauge("tandem_kv_usage_ratio", "Share of the KV pool's blocks held by requests")
        self.hit_tokens = counter("tandem_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache")
        self.query_tokens = counter("tandem_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix "
                                    "cache (the hit rate's denominator)")
        self.prefill_tokens = counter("tandem_prefill_tokens", "Prompt tokens computed")
        self.output_channels = gauge("tandem_output_channels", "Routers' output streams open on this decode worker "
                                     "(one a router: output_channel.py)")
        self.output_channels_expired = counter("tandem_output_channels_expired", "Output streams closed because "
                                               "their router stopped renewing them (a dead or stalled router); the "
                                               "requests on them were cancelled")
        self._preemptions = Counter("tandem_preemptions", "Requests preempted for lack of KV blocks, by what needed "
                                    "them (decode: a running request's next token; prefill_chunk: a prompt chunk)",
                                    names + ["cause"], registry=self.registry)
        self.queue_seconds = Histogram("tandem_queue_seconds", "Wait from arrival to admission (KV blocks and a "
                                       "batch slot)", names, buckets=_QUEUE_BUCKETS,
                                       registry=self.registry).labels(**ids)
        self.transfer_bytes = counter("tandem_kv_transfer_bytes", "KV bytes sent to decode workers")
        self.transfer_seconds = Histogram("tandem_kv_transfer_seconds", "Duration of one KV transfer", names,
                                          buckets=_TRANSFER_BUCKETS, registry=self.registry).labels(**ids)
        self._step = Histogram("tandem_step_seconds", "Duration of one engine step", names + ["phase"],
                               buckets=_STEP_BUCKETS, registry=self.registry)
        self._errors = Counter("tandem_errors", "Failed requests by kind", names + ["kind"], registry=self.registry)
        self._finished = Counter("tandem_requests_finished", "Finished requests by reason", names + ["reason"],
                                 registry=self.registry)
        self._ids = ids
        self._last: EngineStats | None = None

    def update(self, stats: EngineStats) -> None:
        self.waiting.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.awaiting_kv.set(stats.num_awaiting_kv)
        self.kv_used.set(stats.kv_blocks_used)
        self.kv_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        last = self._last
        self.hit_tokens.inc(stats.prefix_hit_tokens_total - (last.prefix_hit_tokens_total if last else 0))
        self.query_tokens.inc(stats.prefix_query_tokens_total - (last.prefix_query_tokens_total if last else 0))
        self.prefill_tokens.inc(stats.prefill_tokens_total - (last.prefill_tokens_total if last else 0))
        for cause, total in stats.preemptions_by_cause.items():
            before = last.preemptions_by_cause.get(cause, 0) if last else 0
            if total > before:
                self._preemptions.labels(**self._ids, cause=cause).inc(total - before)
        self._last = stats

    def observe_step(self, seconds: float, decode_only: bool) -> None:
        """Decode-only steps are the TPOT the operator cares about; mixed steps carry prefill chunks."""
        self._step.labels(**self._ids, phase="decode" if decode_only else "mixed").observe(seconds)

    def observe_transfer(self, num_bytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(num_bytes)
        self.transfer_seconds.observe(seconds)

    def error(self, kind: str) -> None:
        self._errors.labels(**self._ids, kind=kind).inc()

    def finished(self, reason: str) -> None:
        self._finished.labels(**self._ids, reason=reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
