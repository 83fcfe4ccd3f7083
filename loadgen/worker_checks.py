"""What a soak run asks of a Tandem cluster's workers, through its router and Ray: which workers serve,
what each holds (KV blocks, resident memory, its block pool's integrity), and, for chaos, a decode
worker's process to kill.

    workers = ClusterWorkers("http://127.0.0.1:8000")     # reads the Ray namespace from /cluster/config
    workers.ids("decode")                                   # live decode workers, by the router's status
    workers.facts("decode-0")                               # WorkerFacts(blocks_held, integrity_ok, rss_bytes, pid)
    workers.kill("decode-0")                                # SIGKILL; needs the worker on this host

Facts and kills go through Ray (by default the cluster on this host): the soak runs beside ``tandem serve``.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class WorkerFacts:
    worker_id: str
    blocks_held: int  # KV blocks held by requests (the prefix cache's free blocks excluded)
    integrity_ok: bool
    rss_bytes: int
    pid: int


class ClusterWorkers:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 30.0, ray_address: str = "auto"):
        self.url = url.rstrip("/").removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.timeout_s = timeout_s
        config = self._get("/cluster/config")
        self.namespace: str = config["ray"]["namespace"]
        import ray

        if not ray.is_initialized():
            ray.init(address=ray_address, namespace=self.namespace, log_to_driver=False, logging_level=logging.ERROR)

    def status(self) -> dict[str, Any]:
        return self._get("/cluster/status")

    def ids(self, role: str | None = None) -> list[str]:
        return [w["id"] for w in self.status()["workers"] if w["healthy"] and role in (None, w["role"])]

    def facts(self, worker_id: str) -> WorkerFacts:
        import ray

        actor = ray.get_actor(worker_id, namespace=self.namespace)
        try:
            integrity_ok = bool(ray.get(actor.check_integrity.remote(), timeout=self.timeout_s))
        except ray.exceptions.RayTaskError:  # an invariant broke: check_integrity raised
            integrity_ok = False
        refs = [actor.num_used_blocks.remote(), actor.rss_bytes.remote(), actor.ready.remote()]
        held, rss, info = ray.get(refs, timeout=self.timeout_s)
        return WorkerFacts(worker_id, int(held), integrity_ok, int(rss), int(info["pid"]))

    def kill(self, worker_id: str) -> int:
        """SIGKILL the worker's process (as a crash would); returns its pid."""
        pid = self.facts(worker_id).pid
        os.kill(pid, signal.SIGKILL)
        return pid

    def _get(self, path: str) -> dict[str, Any]:
        reply = httpx.get(self.url + path, headers=self.headers, timeout=self.timeout_s)
        reply.raise_for_status()
        data: dict[str, Any] = reply.json()
        return data
