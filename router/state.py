"""What one router holds while it serves: its config, and the state ``create_app``'s lifespan builds
on ``app.state.router`` (handlers read it from there; no module globals)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple

import redis.asyncio as aioredis

from router.auth import AuthConfig
from router.dispatch import Dispatcher
from router.errors import APIError, no_worker_error
from router.kv_event_consumer import KVEventConsumer
from router.metrics import RouterMetrics
from router.policy import PolicyConfig
from router.prefix_index import PrefixIndex
from router.slo_window import RequestTrace, SLOTargets, SLOWindow
from router.worker_client import WorkerClient
from router.worker_directory import WorkerDirectory
from workers.model.open_model import open_model
from workers.model.tokenizer import Tokenizer


@dataclass
class RouterConfig:
    redis_url: str
    cluster: str = "default"
    # The model file (for the tokenizer; the same as the workers'); None: the bundled default.
    model: str | None = None
    # The name clients send as ``model``; None: the model file's stem.
    served_model_name: str | None = None
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # How long the router's own routing decisions count as cached blocks before events confirm them.
    approx_ttl_s: float = 2.0
    poll_interval_s: float = 0.05
    metrics_timeout_s: float = 2.0
    auth: AuthConfig = field(default_factory=AuthConfig)  # API keys; none: open, as on a laptop
    # Times a stream is resumed on another decode worker after its own failed (0: failures end the stream).
    max_failovers: int = 2
    max_request_bytes: int = 8 << 20  # a bigger body is a 413
    # A streamed response whose client takes no data for this long (its send buffer full) is ended and its
    # request cancelled on every worker.
    client_stall_timeout_s: float = 30.0
    # What a request must meet (the cluster YAML's slo section), and the window attainment is read over.
    slo: SLOTargets = SLOTargets(ttft_s=2.0, tpot_s=0.2)
    slo_window_s: float = 60.0


class ClusterShape(NamedTuple):
    block_size: int
    max_model_len: int


@dataclass
class RouterState:
    config: RouterConfig
    model_name: str
    tokenizer: Tokenizer
    redis: aioredis.Redis
    directory: WorkerDirectory
    index: PrefixIndex
    consumer: KVEventConsumer
    dispatcher: Dispatcher
    metrics: RouterMetrics
    client: WorkerClient
    slo: SLOWindow
    router_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # this router among several
    created: int = field(default_factory=lambda: int(time.time()))  # Unix time the router loaded the model

    def require_model(self, model: str) -> None:
        """404 unless ``model`` is the name this router serves."""
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model_not_found", "model")

    def end_request(self, trace: RequestTrace, status: str) -> None:
        """A request ended: into the SLO window and the latency histograms (a client that left counts for
        neither: its request was neither served nor failed)."""
        if status == "499":
            return
        tpot, _ = self.slo.record(trace, time.perf_counter())
        if tpot is not None:
            self.metrics.tpot.observe(tpot)
        if trace.prompt_tokens is not None:
            self.metrics.prompt_lengths.observe(trace.prompt_tokens)
        if trace.first_token_at is not None:
            self.metrics.queue.observe(trace.queue_s)
            self.metrics.prefill_time.observe(max(0.0, trace.first_token_at - trace.arrival - trace.queue_s))
            self.metrics.decode_time.observe(time.perf_counter() - trace.first_token_at)
            self.metrics.output_lengths.observe(trace.output_tokens)

    def cluster_shape(self) -> ClusterShape:
        """Block size and the longest request every decode worker takes; 503 with no decode worker."""
        decoders = self.directory.live("decode")
        if not decoders:
            raise no_worker_error("decode")
        return ClusterShape(decoders[0].info.block_size, min(e.info.max_model_len for e in decoders))


def load_tokenizer(model: str | None) -> tuple[Tokenizer, str]:
    opened = open_model(model)
    return Tokenizer.load(opened.source), opened.name
