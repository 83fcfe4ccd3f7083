"""The prefill and decode pools as Ray actors: start workers, drain them, stop them.

    pools = PoolManager(config, redis_url)
    pools.scale("decode", 2)      # starts decode-1 (returns at once; it registers once loaded)
    pools.poll()                  # call now and then: ready workers, finished drains
    pools.scale("decode", 1)      # drains decode-1: it leaves routing, finishes in-flight, exits

A serving worker that dies (its process killed, its node gone) or stops answering (a probe unanswered
for the pool's ``unresponsive_timeout_s``: a stalled process, a hung device) is lost: it is killed, its
id goes to ``lost`` (the controller takes it out of the registry), and the next ``scale`` starts its
replacement. Killing a stalled one also ends the calls waiting on it (a decode worker's remote
prefill), so nothing waits on it for ever and no late KV write can land.

Nothing here blocks on a worker except ``wait_ready`` (the first start) and ``stop``. Worker ids
count up per role and are never reused within one run, so a draining actor's name never clashes
with a new one. The newest workers drain first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cluster.config import ClusterConfig
from workers.protocol.cluster_keys import ROLES
from workers.service.publisher import PublishConfig

log = logging.getLogger(__name__)


@dataclass
class _Worker:
    worker_id: str
    role: str
    index: int
    handle: Any  # kept: an unreferenced actor exits
    ready_ref: Any | None  # until the worker has loaded its model
    drain_ref: Any | None = None
    drain_deadline: float = 0.0
    pid: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    slow: bool = False  # said that it is slow to start
    probe_ref: Any | None = None  # a liveness probe (its load report) in flight
    probe_sent_at: float = 0.0


class PoolManager:
    def __init__(self, config: ClusterConfig, redis_url: str, say: Callable[[str], None] = log.info,
                 drain_grace_s: float = 1.0, start_retry_s: float = 30.0, slow_start_s: float = 60.0,
                 probe_interval_s: float = 1.0):
        self.config = config
        self.probe_interval_s = probe_interval_s
        self.redis_url = redis_url
        self.say = say
        self.drain_grace_s = drain_grace_s  # routers poll the registry every 50 ms
        self.start_retry_s = start_retry_s
        self.slow_start_s = slow_start_s
        self._workers: dict[str, _Worker] = {}
        self.lost: list[str] = []  # workers lost since the owner last took this list (to clear their registry)
        self._next_index = dict.fromkeys(ROLES, 0)
        self._start_failed_at = dict.fromkeys(ROLES, -float("inf"))

    # ---- views ----
    def starting(self) -> list[str]:
        return [w.worker_id for w in self._workers.values() if w.ready_ref is not None and w.drain_ref is None]

    def draining(self) -> list[str]:
        return [w.worker_id for w in self._workers.values() if w.drain_ref is not None]

    # ---- changes ----
    def scale(self, role: str, replicas: int) -> None:
        """Start or drain workers so that ``role`` has ``replicas`` active ones."""
        active = sorted((w for w in self._workers.values() if w.role == role and w.drain_ref is None),
                        key=lambda w: w.index)
        if len(active) < replicas and time.monotonic() - self._start_failed_at[role] >= self.start_retry_s:
            for _ in range(replicas - len(active)):
                self._start(role)
        for worker in reversed(active[replicas:]):
            self._drain(worker)

    def _start(self, role: str) -> None:
        from workers.actors import start_decode_worker, start_prefill_worker

        cfg = self.config
        index = self._next_index[role]
        self._next_index[role] += 1
        worker_id = f"{role}-{index}"
        publish = PublishConfig(self.redis_url, cfg.name, cfg.ray.namespace)
        engine, resources = cfg.engine_config(role), cfg.worker_resources(role)
        if role == "prefill":
            handle = start_prefill_worker(worker_id, engine, resources, cfg.transport.backend, cfg.ray.namespace,
                                          publish)
        else:
            handle = start_decode_worker(worker_id, engine, resources, cfg.transport.backend, cfg.ray.namespace,
                                         cfg.transport.timeout_s, publish)
        self._workers[worker_id] = _Worker(worker_id, role, index, handle, handle.ready.remote())
        self.say(f"{worker_id} starting")

    def _drain(self, worker: _Worker) -> None:
        import ray

        if worker.ready_ref is not None and not ray.wait([worker.ready_ref], timeout=0)[0]:
            # Not loaded yet (or not even placed): it has served nothing, so it just goes.
            ray.kill(worker.handle)
            self._workers.pop(worker.worker_id)
            self.say(f"{worker.worker_id} cancelled before it was ready")
            return
        timeout_s = self.config.pool(worker.role).drain_timeout_s
        worker.drain_ref = worker.handle.drain.remote(self.drain_grace_s, timeout_s)
        worker.drain_deadline = time.monotonic() + timeout_s + 30.0  # then it is killed regardless
        self.say(f"{worker.worker_id} draining")

    def poll(self) -> None:
        """Note workers that became ready or failed to start, and end those done draining."""
        import ray

        now = time.monotonic()
        for worker in list(self._workers.values()):
            if worker.ready_ref is not None and ray.wait([worker.ready_ref], timeout=0)[0]:
                self._on_ready(worker)
            elif worker.ready_ref is not None and now - worker.started_at > self.slow_start_s and not worker.slow:
                worker.slow = True
                need = _schedulable(self.config.worker_resources(worker.role).demand())
                self.say(f"{worker.worker_id} is not ready after {self.slow_start_s:.0f}s: still loading, or no "
                         f"Ray node has room for it (needs {need}; free now: "
                         f"{_schedulable(ray.available_resources())})")
            if worker.drain_ref is None:
                if worker.ready_ref is None:
                    self._probe(worker, now)
                continue
            if ray.wait([worker.drain_ref], timeout=0)[0]:
                try:
                    outcome = _drain_outcome(ray.get(worker.drain_ref))
                except Exception as e:  # noqa: BLE001 - it died while draining
                    outcome = f"failed while draining: {e}"
                self._end(worker, outcome)
            elif now > worker.drain_deadline:
                self._end(worker, "did not finish draining in time; stopping it")

    def _probe(self, worker: _Worker, now: float) -> None:
        """Ask a serving worker for its load now and then; one that died or stopped answering is lost."""
        import ray

        if worker.probe_ref is None:
            if now - worker.probe_sent_at >= self.probe_interval_s:
                worker.probe_ref, worker.probe_sent_at = worker.handle.load.remote(), now
            return
        if ray.wait([worker.probe_ref], timeout=0)[0]:
            ref, worker.probe_ref = worker.probe_ref, None
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._lose(worker, f"died ({type(e).__name__})")
            except Exception as e:  # noqa: BLE001 - it answered, with an error: alive, but say so
                log.warning("%s: load probe failed: %s", worker.worker_id, e)
        elif now - worker.probe_sent_at > self.config.pool(worker.role).unresponsive_timeout_s:
            self._lose(worker, f"has not answered for {now - worker.probe_sent_at:.0f}s")

    def _lose(self, worker: _Worker, why: str) -> None:
        """A serving worker died or stalled: kill it (ending every call still waiting on it), take it out of
        the registry, and let the next ``scale`` start its replacement."""
        import ray

        self.say(f"{worker.worker_id} {why}; stopping it and starting a replacement")
        ray.kill(worker.handle)
        self._workers.pop(worker.worker_id)
        self.lost.append(worker.worker_id)

    def _on_ready(self, worker: _Worker) -> None:
        import ray

        try:
            info: dict[str, Any] = ray.get(worker.ready_ref)  # type: ignore[arg-type, assignment]
        except Exception as e:  # noqa: BLE001 - a worker that cannot start is reported and dropped
            self.say(f"{worker.worker_id} failed to start: {e}; retrying in {self.start_retry_s:.0f}s")
            self._start_failed_at[worker.role] = time.monotonic()
            self._workers.pop(worker.worker_id)
            ray.kill(worker.handle)
            return
        worker.ready_ref = None
        self._ready(worker, info)

    def _ready(self, worker: _Worker, info: dict[str, Any]) -> None:
        worker.pid = info["pid"]
        kernels = f", CPU kernels {info['cpu_kernels']}" if info.get("cpu_kernels") else ""
        self.say(f"{worker.worker_id} ready (pid {worker.pid}, Ray node {info['node_id'][:12]}{kernels}); "
                 f"{info['kv_cache']}")

    def _end(self, worker: _Worker, outcome: str) -> None:
        import ray

        self.say(f"{worker.worker_id} {outcome}")
        ray.kill(worker.handle)
        self._workers.pop(worker.worker_id)
        self.say(f"{worker.worker_id} exited")

    # ---- first start and last stop ----
    def wait_ready(self, timeout_s: float = 600.0) -> None:
        """Block until every starting worker has loaded (the first start); raise its error if one fails."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = {w.ready_ref: w for w in self._workers.values() if w.ready_ref is not None}
        self.say(f"loading the model on {len(pending)} workers")
        while pending:
            wait_s = min(30.0, max(0.0, deadline - time.monotonic()))
            done, _ = ray.wait(list(pending), num_returns=1, timeout=wait_s)
            names = sorted(w.worker_id for w in pending.values())
            if not done and time.monotonic() >= deadline:
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {names}")
            if not done:
                self.say(f"still waiting for {', '.join(names)} (placed on a node? loading the model?)")
            for ref in done:
                worker = pending.pop(ref)
                worker.ready_ref = None
                self._ready(worker, ray.get(ref))  # raises the worker's start-up error

    def stop(self) -> None:
        """Stop every worker now (the cluster is going away: no draining)."""
        import ray

        for worker in self._workers.values():
            try:
                ray.get(worker.handle.shutdown.remote(), timeout=10)  # leaves the registry, stops the engine
            except Exception:  # noqa: BLE001 - it may be gone already; kill it anyway
                pass
            ray.kill(worker.handle)
        self._workers.clear()


def _drain_outcome(report: dict[str, Any]) -> str:
    """What a worker's ``DrainReport`` says, for the log."""
    if report["unfinished"]:
        return f"drain timed out with {report['unfinished']} requests unfinished"
    return (f"drained in {report['seconds']:.1f}s: {report['in_flight']} in-flight and {report['arrived_after']} "
            "late requests finished")


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources (without memory figures and per-node markers)."""
    return {k: v for k, v in sorted(resources.items())
            if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
