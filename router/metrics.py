"""The router's Prometheus metrics, and the merge of every worker's exposition into one scrape.

Workers keep their own registries (``workers.service.metrics``); ``/metrics`` on a router returns its own
families followed by the workers', with samples of the same family from different workers joined
under one HELP/TYPE header, so one scrape shows the cluster. With several routers, only the holder of the
metrics lease (``router.metrics_lease``) adds the workers' families: each worker series comes once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from router.policy import Route
from router.slo_window import SLOCounts
from workers.protocol.errors import OVERLOADED_KINDS

_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_LENGTH_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class RouterMetrics:
    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        model = {"model_name": model_name}

        def per_request(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=r).labels(**model)

        self.requests = Counter("tandem_router_requests", "HTTP requests finished", ["endpoint", "status"],
                                registry=r)
        self.ttft = per_request("tandem_router_ttft_seconds", "Arrival to first token, seen by the router",
                                _LATENCY_BUCKETS)
        self.tpot = per_request("tandem_router_tpot_seconds", "Per request: (E2E - TTFT) / (output tokens - 1)",
                                _TPOT_BUCKETS)
        self.itl = per_request("tandem_router_itl_seconds", "Gap between consecutive tokens of a stream (a chunk "
                               "of n tokens counts n gaps of a n-th of its wait)", _TPOT_BUCKETS)
        self.queue = per_request("tandem_router_queue_seconds", "Per request: the decode worker's wait before "
                                 "admission (KV blocks, a batch slot)", _LATENCY_BUCKETS)
        self.prefill_time = per_request("tandem_router_prefill_seconds", "Per request: admission to first token "
                                        "(TTFT less the queue: the prompt's compute and KV transfer)",
                                        _LATENCY_BUCKETS)
        self.decode_time = per_request("tandem_router_decode_seconds", "Per request: first token to last",
                                       _LATENCY_BUCKETS)
        self.prompt_lengths = per_request("tandem_router_request_prompt_tokens", "Prompt tokens per request",
                                          _LENGTH_BUCKETS)
        self.output_lengths = per_request("tandem_router_request_output_tokens", "Output tokens per request (the "
                                          "longest choice)", _LENGTH_BUCKETS)
        self.slo_attainment = Gauge("tandem_router_slo_attainment", "Share of requests that met the TTFT and TPOT "
                                    "SLOs over the window (this router's)", registry=r)
        self.goodput = Gauge("tandem_router_goodput_requests_per_second", "Requests per second that met the SLOs "
                             "over the window (this router's)", registry=r)
        self.arrival_rate = Gauge("tandem_router_arrival_requests_per_second", "Valid requests per second over "
                                  "the window (this router's)", registry=r)
        self.e2e = per_request("tandem_router_e2e_seconds", "Arrival to last token", _LATENCY_BUCKETS)
        self.in_flight = Gauge("tandem_router_requests_in_flight", "Requests being served", registry=r)
        self.routes = Counter("tandem_router_routes", "Routing decisions", ["prefill"], registry=r)
        self.rejections = Counter("tandem_router_rejections", "Requests refused before their first token, by "
                                  "reason (429 queue_full / queue_timeout, 503 no_worker / transfer / unavailable)",
                                  ["reason"], registry=r)
        for reason in (*(k.removeprefix("overloaded_") for k in OVERLOADED_KINDS), "no_worker", "transfer",
                       "unavailable"):
            self.rejections.labels(reason=reason)  # at 0 from the start: a rate() over them needs the series
        self.retries = Counter("tandem_router_retries", "Remote prefills retried locally after a transfer error",
                               registry=r)
        self.failovers = Counter("tandem_router_failovers", "Streams resumed on another decode worker after "
                                 "theirs failed, by what failed", ["reason"], registry=r)
        self.stalled_clients = Counter("tandem_router_stalled_clients", "Streams cut off because their client "
                                       "read nothing for router.client_stall_timeout_s", registry=r)
        self.prompt_tokens = Counter("tandem_router_prompt_tokens", "Prompt tokens routed", registry=r)
        self.expected_hit_tokens = Counter(
            "tandem_router_expected_prefix_hit_tokens", "Prompt tokens the chosen worker holds per the index",
            registry=r)
        self.output_tokens = Counter("tandem_router_output_tokens", "Tokens streamed to clients", registry=r)
        self.workers = Gauge("tandem_router_live_workers", "Workers in routing", ["role"], registry=r)
        self.pool_targets = Gauge("tandem_router_pool_target_workers", "Workers each pool should have",
                                  ["role"], registry=r)
        self.pool_changing = Gauge("tandem_router_pool_changing_workers", "Workers starting or draining",
                                   ["state"], registry=r)
        self.index_nodes = Gauge("tandem_router_prefix_index_nodes", "Blocks in the prefix index", registry=r)
        self.kv_events = Gauge("tandem_router_kv_event_batches_applied", "KV event batches applied", registry=r)
        self.kv_resyncs = Gauge("tandem_router_kv_event_resyncs", "Snapshot reloads after a gap", registry=r)

    def routed(self, route: Route, block_size: int) -> None:
        self.routes.labels(prefill="local" if route.prefill_worker is None else "remote").inc()
        self.expected_hit_tokens.inc(route.prefill_overlap_blocks * block_size)

    def observed(self, counts: SLOCounts) -> None:
        """The SLO window's figures, as gauges (set at each scrape)."""
        if counts.attainment is not None:
            self.slo_attainment.set(counts.attainment)
        self.goodput.set(counts.goodput_rps)
        self.arrival_rate.set(counts.rate(counts.arrived))

    def tokens_arrived(self, gap_s: float, num_tokens: int) -> None:
        for _ in range(num_tokens):
            self.itl.observe(gap_s / num_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def merge_expositions(texts: Iterable[bytes], extra_labels: Mapping[str, str] | None = None) -> bytes:
    """Several Prometheus text expositions as one: each family once, with all its samples, each sample also
    carrying ``extra_labels`` it lacks (the model a worker serves)."""
    families: dict[str, tuple[str, str, list[str]]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text.decode("utf-8")):
            # The text format names a counter's header after its ``_total`` sample.
            name = family.name + "_total" if family.type == "counter" else family.name
            _, _, lines = families.setdefault(name, (family.type, family.documentation, []))
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # creation timestamps: noise in a merged scrape
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted({**(extra_labels or {}),
                                                                              **s.labels}.items()))
                value = floatToGoString(s.value)
                lines.append(f"{s.name}{{{labels}}} {value}" if labels else f"{s.name} {value}")
    out: list[str] = []
    for name, (kind, doc, lines) in families.items():
        if not lines:
            continue  # only creation timestamps
        out.append(f"# HELP {name} {_escape(doc)}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(lines)
    return ("\n".join(out) + "\n").encode("utf-8")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
