"""Names of what workers publish in Redis and routers read (the shared vocabulary, so it lives here).

    tandem:<cluster>:workers           hash   worker id -> msgpack WorkerInfo (the registry)
    tandem:<cluster>:load:<worker>     string msgpack WorkerLoad; its TTL is the worker's heartbeat
    tandem:<cluster>:kv:<worker>       stream KV events, one entry per batch: epoch, seq, events
    tandem:<cluster>:kvsnap:<worker>   string msgpack KVSnapshot: every cached block at one seq

Several clusters can share one Redis under different names.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
