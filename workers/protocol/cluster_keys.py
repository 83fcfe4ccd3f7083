"""Names of what workers publish in Redis and routers read (the shared vocabulary, so it lives here).

    tandem:<cluster>:workers           hash   worker id -> msgpack WorkerInfo (the registry)
    tandem:<cluster>:load:<worker>     string msgpack WorkerLoad; its TTL is the worker's heartbeat
    tandem:<cluster>:kv:<worker>       stream KV events, one entry per batch: epoch, seq, events
    tandem:<cluster>:kvsnap:<worker>   string msgpack KVSnapshot: every cached block at one seq
    tandem:<cluster>:pools             hash   role -> msgpack PoolTarget (what the pools should be)
    tandem:<cluster>:controller        string msgpack ControllerState; its TTL is the controller's heartbeat
    tandem:<cluster>:slo               hash   router id -> msgpack SLOReport (router/slo_report.py)
    tandem:<cluster>:seen:<reader>     string a router's mark that Redis still has its data (its absence
                                              tells a Redis restarted empty or flushed from workers leaving)

Routers write pool targets (``tandem scale``); the controller in ``tandem serve`` makes the pools follow.

Several clusters can share one Redis under different names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROLES = ("prefill", "decode")  # the two pools; a worker's ``role``
# The most workers a pool may have (targets cross Redis as msgpack: a bound keeps every size packable).
MAX_POOL_WORKERS = 4096


@dataclass(frozen=True)
class ClusterKeys:
    cluster: str = "default"

    @property
    def registry(self) -> str:
        return f"tandem:{self.cluster}:workers"

    def load(self, worker_id: str) -> str:
        return f"tandem:{self.cluster}:load:{worker_id}"

    def kv_stream(self, worker_id: str) -> str:
        return f"tandem:{self.cluster}:kv:{worker_id}"

    def kv_snapshot(self, worker_id: str) -> str:
        return f"tandem:{self.cluster}:kvsnap:{worker_id}"

    @property
    def pool_targets(self) -> str:
        return f"tandem:{self.cluster}:pools"

    @property
    def controller(self) -> str:
        return f"tandem:{self.cluster}:controller"

    @property
    def slo(self) -> str:
        return f"tandem:{self.cluster}:slo"

    def data_mark(self, reader_id: str) -> str:
        return f"tandem:{self.cluster}:seen:{reader_id}"

    @property
    def metrics_lease(self) -> str:
        """The id of the router that exports the workers' metrics (one, however many are scraped)."""
        return f"tandem:{self.cluster}:metrics-lease"


@dataclass
class WorkerInfo:
    """A worker's registration: how routers reach it and what it has."""

    worker_id: str
    role: str  # "prefill" or "decode"
    ray_namespace: str | None
    block_size: int
    kv_blocks_total: int
    max_model_len: int
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class KVSnapshot:
    """A worker's whole prefix cache as (hash, parent) pairs, valid after stream entry ``seq`` of ``epoch``."""

    epoch: int
    seq: int
    stream_id: str
    blocks: list[list[int | None]]


@dataclass
class PoolTarget:
    """How many workers a pool should have, within its bounds."""

    replicas: int
    min_replicas: int
    max_replicas: int


@dataclass
class ControllerState:
    """What the pool controller reports: the running config and the workers changing state."""

    pid: int
    config: dict[str, object]  # the running cluster config, pools as targeted now (``tandem apply`` diffs it)
    starting: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    # With the autoscaler on: its corrections, the last interval's load and need, its latest decisions.
    autoscaler: dict[str, object] | None = None
