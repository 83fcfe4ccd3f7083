"""What ``tandem serve`` starts and stops: Ray (local, or joined), Redis (embedded, or a URL), the
prefill and decode pools as Ray actors, and the controller that resizes them while it runs.
Everything it started, it stops.
"""

from __future__ import annotations

import logging
import math
import os
import sys

from cluster.autoscaler import Autoscaler, AutoscalerSettings
from cluster.capacity_model import CapacityModel
from cluster.config import ClusterConfig, ConfigError, check_kv_budget
from cluster.embedded_redis import EmbeddedRedis
from cluster.pool_controller import PoolController
from cluster.pool_manager import PoolManager
from router.slo_window import SLOTargets
from workers.protocol.cluster_keys import ROLES

log = logging.getLogger(__name__)


def say(message: str) -> None:
    print(f"[tandem] {message}", file=sys.stderr, flush=True)


class RayConnection:
    """This process's place in a Ray cluster: a new local one (``address="local"``) or one it joins."""

    def __init__(self, address: str, namespace: str, num_cpus: int | None = None):
        self.address, self.namespace, self.num_cpus = address, namespace, num_cpus
        self._started = False

    def start(self) -> None:
        import ray

        if ray.is_initialized():
            return  # a caller's own connection (tests): theirs to end
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # local runs: no token files (see MACHINE.md)
        say("starting a local Ray cluster" if self.address == "local" else f"joining Ray at {self.address}")
        ray.init(address=self.address, namespace=self.namespace, include_dashboard=False, num_cpus=self.num_cpus,
                 log_to_driver=False, runtime_env={"env_vars": {"RAY_AUTH_MODE": os.environ["RAY_AUTH_MODE"]}})
        self._started = True

    def stop(self) -> None:
        import ray

        if self._started and ray.is_initialized():
            ray.shutdown()
        self._started = False


class Launcher:
    def __init__(self, config: ClusterConfig):
        self.config = config
        self.redis: EmbeddedRedis | None = None
        self.redis_url = config.redis.url or ""
        self.pools: PoolManager | None = None
        self.controller: PoolController | None = None
        self._ray: RayConnection | None = None

    def check_model(self) -> None:
        """Config errors that need the model's shape (KV bytes per token), before anything starts."""
        from workers.model.open_model import open_model

        try:
            model = open_model(self.config.model.path).config
        except (OSError, ValueError) as e:
            raise ConfigError(f"model.path: {e}") from None
        m = self.config.model
        kv_dtype = m.kv_cache_dtype
        if kv_dtype == "auto":  # each worker decides (int8 under GGUF weights on CPU): assume the smaller here,
            kv_dtype = m.dtype if m.weight_format == "dense" else "int8"  # the engine checks again at start
        itemsize = {"float16": 2, "bfloat16": 2, "int8": 1}.get(kv_dtype, 4)
        scale_bytes = 4 if kv_dtype == "int8" else 0  # an int8 head row's fp32 scale (kernels/kv_quant.py)
        check_kv_budget(self.config, model.kv_bytes_per_token(itemsize, scale_bytes), model.max_position_embeddings)

    def start(self) -> None:
        """Ray, Redis, the pools at their configured size (blocks until loaded), then the controller."""
        import ray

        cfg = self.config
        if cfg.redis.url is None:
            self.redis = EmbeddedRedis()
            self.redis_url = self.redis.url
            say(f"embedded Redis at {self.redis_url}")
        # "local": a new cluster of our own, never one a `ray start` left on this machine.
        self._ray = RayConnection(cfg.ray.address or "local", cfg.ray.namespace,
                                  None if cfg.ray.address else self.local_num_cpus())
        self._ray.start()
        self._warn_missing_resources(ray.cluster_resources())
        self.pools = PoolManager(cfg, self.redis_url, say)
        for role in ROLES:
            self.pools.scale(role, cfg.pool(role).replicas)
        self.pools.wait_ready()
        self.controller = PoolController(self.pools, self.redis_url, cfg, autoscaler=self._autoscaler(), say=say)
        self.controller.start()

    def _autoscaler(self) -> Autoscaler | None:
        cfg = self.config
        if not cfg.autoscaler.enabled:
            return None
        a = cfg.autoscaler
        slo = SLOTargets(cfg.slo.ttft_ms / 1000, cfg.slo.tpot_ms / 1000)
        model = CapacityModel(cfg.autoscaler_profile(), slo, cfg.slo.attainment, cfg.decode.engine.prefill_chunk_size)
        settings = AutoscalerSettings(a.interval_s, a.scale_down_delay_s, cfg.slo.attainment, a.up_margin,
                                      a.down_margin)
        say(f"autoscaler on: every {a.interval_s:g}s toward TTFT <= {cfg.slo.ttft_ms:g} ms and TPOT <= "
            f"{cfg.slo.tpot_ms:g} ms for {cfg.slo.attainment:.0%} of requests")
        return Autoscaler(model, settings)

    def local_num_cpus(self) -> int:
        """Logical CPUs of a local cluster: this machine's cores, or enough for every pool at its
        ``max_replicas`` (so ``tandem scale`` within the bounds never waits for a CPU; the workers then
        share the cores)."""
        cfg = self.config
        if cfg.ray.num_cpus is not None:
            return cfg.ray.num_cpus
        wanted = sum(cfg.pool(r).max_replicas * cfg.pool(r).resources.num_cpus for r in ROLES)
        return max(os.cpu_count() or 1, math.ceil(wanted))

    def _warn_missing_resources(self, available: dict[str, float]) -> None:
        """A worker asking for more than any node offers waits (an autoscaler may add the node): say so."""
        for role in ROLES:
            wanted = self.config.worker_resources(role).demand()
            short = [f"{k}={v:g} (the cluster has {available.get(k, 0):g})" for k, v in wanted.items()
                     if v > available.get(k, 0)]
            if short:
                say(f"warning: {role} workers wait for resources no Ray node offers now: {', '.join(short)}")

    def stop(self) -> None:
        import ray

        if self.controller is not None:
            self.controller.stop()
            self.controller = None
        if ray.is_initialized() and self.pools is not None:
            self.pools.stop()
        if self._ray is not None:
            self._ray.stop()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
