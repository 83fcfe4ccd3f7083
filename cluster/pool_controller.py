"""Makes the pools follow their targets in Redis, which any router may change (``tandem scale``,
``tandem apply``, later the autoscaler): desired state in one place, one reconciler acting on it.

    controller = PoolController(pools, redis_url, config)
    controller.start()   # writes the config's targets, then reconciles every ``interval_s``
    controller.stop()

Its heartbeat key tells routers that someone acts on targets (else they answer 503 to a scale), and
carries the running config and the workers starting or draining, for ``tandem status`` and ``apply``.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import asdict

import redis

from cluster.config import ClusterConfig
from cluster.pool_manager import PoolManager
from workers.protocol.cluster_keys import ROLES, ClusterKeys, ControllerState, PoolTarget
from workers.protocol.messages import pack, unpack

log = logging.getLogger(__name__)


def pool_targets(config: ClusterConfig) -> dict[str, PoolTarget]:
    return {role: PoolTarget(config.pool(role).replicas, config.pool(role).min_replicas,
                             config.pool(role).max_replicas) for role in ROLES}


class PoolController:
    def __init__(self, pools: PoolManager, redis_url: str, config: ClusterConfig, interval_s: float = 0.5,
                 heartbeat_ttl_s: float = 5.0):
        self.pools = pools
        self.keys = ClusterKeys(config.name)
        self.config = config
        self.interval_s = interval_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-controller", daemon=True)
        self.targets = pool_targets(config)

    def start(self) -> None:
        """This run's config sets the targets (stale ones from an earlier run are replaced)."""
        self._redis.delete(self.keys.pool_targets)
        self._redis.hset(self.keys.pool_targets, mapping={r: pack(t) for r, t in self.targets.items()})
        self._heartbeat()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        try:
            self._redis.delete(self.keys.controller, self.keys.pool_targets)
        except redis.RedisError:
            pass  # the heartbeat expires by itself
        self._redis.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile()
            except (redis.RedisError, OSError) as e:
                log.warning("pool controller: Redis unreachable (%s); pools stay as they are", e)
            except Exception:  # noqa: BLE001 - keep reconciling; a Ray hiccup must not stop the controller
                log.exception("pool controller: reconcile failed")

    def reconcile(self) -> None:
        self.pools.poll()
        stored: dict[bytes, bytes] = self._redis.hgetall(self.keys.pool_targets)  # type: ignore[assignment]
        for role in ROLES:
            data = stored.get(role.encode())
            if data is not None:
                self.targets[role] = unpack(PoolTarget, data)
            self.pools.scale(role, self.targets[role].replicas)
        self._heartbeat()

    def _heartbeat(self) -> None:
        config = self.config.model_dump(mode="json")
        for role, target in self.targets.items():  # the pools as they are meant to be now
            config[role].update(asdict(target))
        state = ControllerState(os.getpid(), config, self.pools.starting(), self.pools.draining())
        self._redis.set(self.keys.controller, pack(state), px=self.heartbeat_ttl_ms)
