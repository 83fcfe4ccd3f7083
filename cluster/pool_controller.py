"""Makes the pools follow their targets in Redis, which any router may change (``tandem scale``,
``tandem apply``, later the autoscaler): desired state in one place, one reconciler acting on it.

    controller = PoolController(pools, redis_url, config, autoscaler=Autoscaler(...))
    controller.start()   # writes the config's targets, then reconciles every ``interval_s``
    controller.stop()

With an autoscaler, every ``autoscaler.settings.interval_s`` it also reads the cluster's interval
(``ClusterObserver``) and writes the replicas the autoscaler decides into the same targets (bounds stay
the operator's), so a manual scale and the autoscaler meet in one place: the next decision starts from
whatever the targets are then.

A worker that dies or stops answering is replaced (``PoolManager``); the controller takes it out of the
registry at once, so routers stop choosing it before its heartbeat would have lapsed.

Its heartbeat key tells routers that someone acts on targets (else they answer 503 to a scale), and
carries the running config and the workers starting or draining, for ``tandem status`` and ``apply``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict

import redis

from cluster.autoscaler import Autoscaler, Decision, Observation
from cluster.cluster_observer import ClusterObserver
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
                 heartbeat_ttl_s: float = 5.0, autoscaler: Autoscaler | None = None,
                 say: Callable[[str], None] = log.info):
        self.pools = pools
        self.keys = ClusterKeys(config.name)
        self.config = config
        self.interval_s = interval_s
        self.heartbeat_ttl_ms = int(heartbeat_ttl_s * 1000)
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pool-controller", daemon=True)
        self.targets = pool_targets(config)
        self.autoscaler = autoscaler
        self.say = say
        self.decisions: deque[dict[str, object]] = deque(maxlen=20)  # the latest, for /cluster/status
        self._observer = ClusterObserver(self._redis, self.keys)
        self._observed: Observation | None = None
        self._next_autoscale = time.monotonic() + (autoscaler.settings.interval_s if autoscaler else 0.0)

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
                if self.autoscaler is not None and time.monotonic() >= self._next_autoscale:
                    self._next_autoscale = time.monotonic() + self.autoscaler.settings.interval_s
                    self.autoscale()
                self.reconcile()
            except (redis.RedisError, OSError) as e:
                log.warning("pool controller: Redis unreachable (%s); pools stay as they are", e)
            except Exception:  # noqa: BLE001 - keep reconciling; a Ray hiccup must not stop the controller
                log.exception("pool controller: reconcile failed")

    def reconcile(self) -> None:
        self.pools.poll()
        lost, self.pools.lost = self.pools.lost, []
        if lost:  # routers drop them (and their prefix-index entries) now, not when their heartbeats lapse
            self._redis.hdel(self.keys.registry, *lost)
            self._redis.delete(*(self.keys.load(w) for w in lost))
        stored: dict[bytes, bytes] = self._redis.hgetall(self.keys.pool_targets)  # type: ignore[assignment]
        for role in ROLES:
            data = stored.get(role.encode())
            if data is not None:
                self.targets[role] = unpack(PoolTarget, data)
            self.pools.scale(role, self.targets[role].replicas)
        self._heartbeat()

    def autoscale(self) -> list[Decision]:
        """One autoscaler interval: observe, decide, write the new replicas into the targets."""
        assert self.autoscaler is not None
        observation = self._observer.observe()
        stored: dict[bytes, bytes] = self._redis.hgetall(self.keys.pool_targets)  # type: ignore[assignment]
        targets = {r: unpack(PoolTarget, stored[r.encode()]) if r.encode() in stored else self.targets[r]
                   for r in ROLES}
        decisions = self.autoscaler.decide(observation, targets, time.monotonic())
        for d in decisions:
            old = targets[d.role]
            self._redis.hset(self.keys.pool_targets, d.role, pack(PoolTarget(d.new, old.min_replicas,
                                                                              old.max_replicas)))
            self.decisions.append({"at": round(time.time(), 1), "role": d.role, "from": d.old, "to": d.new,
                                   "reason": d.reason})
            self.say(f"autoscaler: {d.role} {d.old} -> {d.new} ({d.reason})")
        self._observed = observation
        return decisions

    def _autoscaler_state(self) -> dict[str, object] | None:
        scaler = self.autoscaler
        if scaler is None:
            return None
        load = scaler.last_load
        observed = self._observed
        return {"interval_s": scaler.settings.interval_s, "scale_down_delay_s": scaler.settings.scale_down_delay_s,
                "corrections": {"ttft": round(scaler.corrections[0], 3), "tpot": round(scaler.corrections[1], 3)},
                "load": None if load is None else {"rate": round(load.rate, 3),
                                                   "prompt_tokens": round(load.prompt_tokens, 1),
                                                   "output_tokens": round(load.output_tokens, 1)},
                "needed": scaler.last_needed,
                "interval": None if observed is None else observed.counts.summary(),
                "decisions": list(self.decisions)}

    def _heartbeat(self) -> None:
        config = self.config.model_dump(mode="json")
        for role, target in self.targets.items():  # the pools as they are meant to be now
            config[role].update(asdict(target))
        state = ControllerState(os.getpid(), config, self.pools.starting(), self.pools.draining(),
                                self._autoscaler_state())
        self._redis.set(self.keys.controller, pack(state), px=self.heartbeat_ttl_ms)
