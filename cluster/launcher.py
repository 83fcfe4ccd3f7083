"""What ``tandem serve`` starts and stops: Ray (local, or joined), Redis (embedded, or a URL), the
prefill and decode pools as Ray actors, and the router app. Everything it started, it stops.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from cluster.config import ClusterConfig, ConfigError, check_kv_budget
from cluster.embedded_redis import EmbeddedRedis
from workers.publisher import PublishConfig

log = logging.getLogger(__name__)


def say(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


class Launcher:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis.url or ""
        self.workers: dict[str, Any] = {}  # worker id -> actor handle (kept: an unreferenced actor exits)
        self._started_ray = False

    def check_model(self) -> None:
        """Config errors that need the model's shape (KV bytes per token), before anything starts."""
        from workers.model_cache import prepared_source
        from workers.model_loader import load_model_config, resolve_model_source

        try:
            model = load_model_config(prepared_source(resolve_model_source(self.config.model.path)))
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: {e}") from None
        itemsize = 2 if self.config.model.dtype in ("float16", "bfloat16") else 4
        check_kv_budget(self.config, model.kv_bytes_per_token(itemsize), model.max_position_embeddings)

    def start(self) -> None:
        import ray

        cfg = self.config
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local runs: no token files (see MACHINE.md)
        if cfg.redis.url is None:
            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.url
            say(f"embedded Redis at {self.redis_url}")
        if not ray.is_initialized():
            say("joining Ray at " + cfg.ray.address if cfg.ray.address else "starting a local Ray cluster")
            ray.init(address=cfg.ray.address, namespace=cfg.ray.namespace, include_dashboard=False,
                     num_cpus=None if cfg.ray.address else cfg.ray.num_cpus, log_to_driver=False,
                     runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
            self._started_ray = True
        for role in ("prefill", "decode"):
            for i in range(cfg.pool(role).replicas):
                self.add_worker(role, f"{role}-{i}")
        self.wait_ready()

    def add_worker(self, role: str, worker_id: str) -> Any:
        from workers.actors import start_decode_worker, start_prefill_worker

        cfg = self.config
        publish = PublishConfig(self.redis_url, cfg.name, cfg.ray.namespace)
        engine, resources = cfg.engine_config(role), cfg.worker_resources(role)
        if role == "prefill":
            handle = start_prefill_worker(worker_id, engine, resources, cfg.transport.backend, cfg.ray.namespace,
                                          publish)
        else:
            handle = start_decode_worker(worker_id, engine, resources, cfg.transport.backend, cfg.ray.namespace,
                                         cfg.transport.timeout_s, publish)
        self.workers[worker_id] = handle
        return handle

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        import ray

        pending = {w.ready.remote(): wid for wid, w in self.workers.items()}
        deadline = time.monotonic() + timeout_s
        say(f"loading the model on {len(pending)} workers")
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TimeoutError(f"workers not ready after {timeout_s:.0f}s: {sorted(pending.values())}")
            for ref in done:
                worker_id = pending.pop(ref)
                ray.get(ref)  # raises the worker's start-up error
                say(f"{worker_id} ready")

    def stop(self) -> None:
        import ray

        if ray.is_initialized():
            for handle in self.workers.values():
                try:
                    ray.get(handle.shutdown.remote(), timeout=10)  # leaves the registry, stops the engine
                except Exception:  # noqa: BLE001 - it may be gone already; kill it anyway
                    pass
                ray.kill(handle)
            self.workers.clear()
            if self._started_ray:
                ray.shutdown()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
