"""The router's FastAPI app factory: state built in ``lifespan`` on ``app.state.router``.

    app = create_app(RouterConfig(redis_url=...), client=RayWorkerClient(namespace))
    uvicorn.run(app, host=..., port=...)

Background tasks keep the picture of the cluster fresh: the worker directory (registry and load,
every 50 ms), the KV event consumer (feeding the prefix index) and the expiry of approximate index
entries. Several routers built on one Redis follow the same streams and decide alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from router.auth import APIKeyAuth
from router.body_limit import BodyLimit
from router.dispatch import Dispatcher
from router.errors import error_responses, install_error_handlers
from router.kv_event_consumer import KVEventConsumer
from router.metrics import RouterMetrics, merge_expositions
from router.metrics_lease import holds_metrics_lease, release_metrics_lease
from router.openai_api import api
from router.pool_api import pools_api, read_controller, read_targets
from router.prefix_index import PrefixIndex
from router.slo_report import cluster_window, report_loop
from router.slo_window import SLOWindow
from router.state import RouterConfig, RouterState, load_tokenizer
from router.task_stop import cancel_and_wait
from router.tokenize_api import tokenize_api
from router.worker_client import WorkerClient
from router.worker_directory import WorkerDirectory
from workers.model.tokenizer import Tokenizer
from workers.protocol.cluster_keys import ROLES, ClusterKeys, ControllerState

log = logging.getLogger(__name__)


def create_app(config: RouterConfig, client: WorkerClient, tokenizer: Tokenizer | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tok, default_name = (tokenizer, "tandem") if tokenizer is not None else load_tokenizer(config.model)
        redis = aioredis.Redis.from_url(config.redis_url, socket_connect_timeout=2.0)
        keys = ClusterKeys(config.cluster)
        model_name = config.served_model_name or default_name
        metrics = RouterMetrics(model_name)
        index = PrefixIndex()
        directory = WorkerDirectory(redis, keys, config.poll_interval_s)
        consumer = KVEventConsumer(redis, keys, index)
        directory.on_removed.extend([consumer.forget, client.forget])
        dispatcher = Dispatcher(directory, index, client, config.policy, metrics, config.approx_ttl_s,
                                config.max_failovers)
        state = RouterState(config, model_name, tok, redis, directory, index,
                            consumer, dispatcher, metrics, client, SLOWindow(config.slo, config.slo_window_s))
        app.state.router = state
        await directory.start()
        tasks = [asyncio.create_task(consumer.run(directory.event_positions), name="kv-events"),
                 asyncio.create_task(_expire_loop(index), name="index-expiry"),
                 asyncio.create_task(report_loop(redis, keys, state.router_id, state.slo), name="slo-report")]
        try:
            yield
        finally:
            await cancel_and_wait(tasks)
            with contextlib.suppress(aioredis.RedisError):
                await redis.hdel(keys.slo, state.router_id)
            await release_metrics_lease(redis, keys, state.router_id)
            await directory.stop()
            await redis.aclose()

    # Every route: a body or key the middleware refuses, or a parameter that fails validation.
    app = FastAPI(title="Tandem router", lifespan=lifespan, responses=error_responses(400, 401, 413))
    app.add_middleware(APIKeyAuth, config=config.auth)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)  # outermost: before auth reads anything
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(pools_api)
    app.include_router(tokenize_api)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready", responses=error_responses(503))
    async def ready(request: Request) -> JSONResponse:
        state: RouterState = request.app.state.router
        num_decode, num_prefill = len(state.directory.live("decode")), len(state.directory.live("prefill"))
        ok = num_decode > 0 and state.directory.last_poll_ok
        body = {"ready": ok, "decode_workers": num_decode, "prefill_workers": num_prefill,
                "redis": state.directory.last_poll_ok}
        return JSONResponse(body, 200 if ok else 503, headers=None if ok else {"Retry-After": "1"})

    @app.get("/cluster/status")
    async def cluster_status(request: Request) -> dict[str, object]:
        """Pools and every live worker's last load report (what ``tandem status`` shows)."""
        state: RouterState = request.app.state.router
        now = time.monotonic()
        workers = [{"id": w, "role": e.info.role, "healthy": now - e.seen_at < 5.0,
                    "num_running": e.load.num_running, "num_waiting": e.load.num_waiting,
                    "kv_blocks_used": e.load.kv_blocks_used, "kv_blocks_total": e.load.kv_blocks_total,
                    "prefix_cache_hit_tokens": e.load.prefix_cache_hit_tokens,
                    "queued_prefill_tokens": e.load.waiting_prefill_tokens}
                   for w, e in sorted(state.directory.workers.items())]
        pools = {role: sum(1 for w in workers if w["role"] == role) for role in ROLES}
        targets, controller = await _pools(state)
        return {"cluster": state.config.cluster, "model": state.model_name, "pools": pools, "targets": targets,
                "starting": controller.starting if controller else [],
                "draining": controller.draining if controller else [], "workers": workers,
                "slo": await _slo_status(state), "autoscaler": controller.autoscaler if controller else None}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, object]:
        state: RouterState = request.app.state.router
        decoders = state.directory.live("decode")
        entry: dict[str, object] = {"id": state.model_name, "object": "model", "created": state.created,
                                    "owned_by": "tandem"}
        if decoders:
            entry["max_model_len"] = min(e.info.max_model_len for e in decoders)
        return {"object": "list", "data": [entry]}

    @app.get("/metrics", response_class=PlainTextResponse)  # Prometheus' text format, so documented
    async def metrics(request: Request) -> Response:
        state: RouterState = request.app.state.router
        _update_gauges(state, *await _pools(state))
        keys = ClusterKeys(state.config.cluster)
        exports_workers = await holds_metrics_lease(state.redis, keys, state.router_id)
        worker_ids = list(state.directory.workers) if exports_workers else []
        results = await asyncio.gather(
            *(asyncio.wait_for(state.client.metrics(w), state.config.metrics_timeout_s) for w in worker_ids),
            return_exceptions=True)
        workers = [r for r in results if isinstance(r, bytes)]
        body = merge_expositions([state.metrics.exposition()])
        if workers:  # the router's and the workers' families are apart: the two still make one exposition
            body += merge_expositions(workers, {"model_name": state.model_name})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _pools(state: RouterState) -> tuple[dict[str, int], ControllerState | None]:
    """Each pool's target size, and the controller's report (none without a controller or Redis)."""
    keys = ClusterKeys(state.config.cluster)
    try:
        targets = {r: t.replicas for r, t in (await read_targets(state.redis, keys)).items()}
        return targets, await read_controller(state.redis, keys)
    except aioredis.RedisError:
        return {}, None


async def _slo_status(state: RouterState) -> dict[str, object]:
    """The SLO, this router's window, and every router's windows merged (None without Redis)."""
    targets = state.config.slo
    status: dict[str, object] = {"ttft_ms": targets.ttft_s * 1000, "tpot_ms": targets.tpot_s * 1000,
                                 "router": state.slo.counts().summary(), "cluster": None}
    try:
        merged, num_routers = await cluster_window(state.redis, ClusterKeys(state.config.cluster))
        status["cluster"] = {**merged.summary(), "routers": num_routers}
    except aioredis.RedisError:
        pass
    return status


def _update_gauges(state: RouterState, targets: dict[str, int], controller: ControllerState | None) -> None:
    m = state.metrics
    for role in ROLES:
        m.workers.labels(role=role).set(len(state.directory.live(role)))
        if role in targets:
            m.pool_targets.labels(role=role).set(targets[role])
    m.pool_changing.labels(state="starting").set(len(controller.starting) if controller else 0)
    m.pool_changing.labels(state="draining").set(len(controller.draining) if controller else 0)
    m.observed(state.slo.counts())
    m.index_nodes.set(state.index.num_nodes)
    m.kv_events.set(state.consumer.num_events_applied)
    m.kv_resyncs.set(state.consumer.num_resyncs)


async def _expire_loop(index: PrefixIndex, interval_s: float = 0.25) -> None:
    while True:
        await asyncio.sleep(interval_s)
        index.expire(time.monotonic())
