"""Pool targets over HTTP: any router reads and changes them in Redis; the controller in
``tandem serve`` makes the pools follow (``tandem scale`` and ``tandem apply`` call these).

    POST /cluster/scale   {"decode": {"replicas": 2}}  -> 202 {"targets": {...}}
    GET  /cluster/pools   -> {"targets": {...}, "controller": {"pid", "starting", "draining"} | null}
    GET  /cluster/config  -> the running cluster config (what ``tandem apply`` compares a file with)
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import redis.asyncio as aioredis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt
from redis.exceptions import WatchError

from router.errors import APIError, error_responses
from workers.protocol.cluster_keys import MAX_POOL_WORKERS, ROLES, ClusterKeys, ControllerState, PoolTarget
from workers.protocol.messages import pack, unpack

pools_api = APIRouter(responses=error_responses(503))


class PoolChange(BaseModel):
    model_config = ConfigDict(extra="forbid")
    replicas: StrictInt | None = Field(default=None, ge=0, le=MAX_POOL_WORKERS)
    min_replicas: StrictInt | None = Field(default=None, ge=0, le=MAX_POOL_WORKERS)
    max_replicas: StrictInt | None = Field(default=None, ge=1, le=MAX_POOL_WORKERS)


class ScaleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prefill: PoolChange | None = None
    decode: PoolChange | None = None


async def read_controller(redis: aioredis.Redis, keys: ClusterKeys) -> ControllerState | None:
    data: bytes | None = await redis.get(keys.controller)  # type: ignore[assignment]
    return None if data is None else unpack(ControllerState, data)


async def read_targets(redis: aioredis.Redis, keys: ClusterKeys) -> dict[str, PoolTarget]:
    return _decode_targets(await redis.hgetall(keys.pool_targets))


def _decode_targets(stored: dict[Any, Any]) -> dict[str, PoolTarget]:
    return {k.decode(): unpack(PoolTarget, v) for k, v in sorted(stored.items())}


def _keys(request: Request) -> tuple[aioredis.Redis, ClusterKeys]:
    state = request.app.state.router
    return state.redis, ClusterKeys(state.config.cluster)


async def _require_controller(redis: aioredis.Redis, keys: ClusterKeys) -> ControllerState:
    controller = await read_controller(redis, keys)
    if controller is None:
        raise APIError(503, f"no pool controller runs for cluster {keys.cluster!r} (tandem serve runs one); "
                            "the pools cannot change now", "no_controller", retry_after_s=5)
    return controller


def _apply(target: PoolTarget, change: PoolChange, role: str) -> PoolTarget:
    """The changed target, or a 400 naming the field that breaks min <= replicas <= max."""
    new = PoolTarget(**{**asdict(target), **change.model_dump(exclude_none=True)})
    if new.min_replicas > new.max_replicas:
        raise APIError(400, f"{role}.min_replicas: {new.min_replicas} exceeds max_replicas ({new.max_replicas})",
                       "invalid_request", f"{role}.min_replicas")
    if not new.min_replicas <= new.replicas <= new.max_replicas:
        raise APIError(400, f"{role}.replicas: {new.replicas} is outside the pool's bounds [{new.min_replicas}, "
                            f"{new.max_replicas}] (min_replicas, max_replicas)", "invalid_request",
                       f"{role}.replicas")
    return new


@pools_api.post("/cluster/scale", status_code=202)
async def scale(body: ScaleRequest, request: Request) -> dict[str, Any]:
    redis, keys = _keys(request)
    await _require_controller(redis, keys)
    async with redis.pipeline(transaction=True) as pipe:
        while True:  # optimistic: another router changing targets meanwhile makes us read again
            try:
                await pipe.watch(keys.pool_targets)
                targets = _decode_targets(await pipe.hgetall(keys.pool_targets))
                changed = {}
                for role in ROLES:
                    change: PoolChange | None = getattr(body, role)
                    if change is not None:
                        if role not in targets:
                            raise APIError(503, f"the {role} pool has no target yet; try again", "no_controller",
                                           retry_after_s=1)
                        changed[role] = targets[role] = _apply(targets[role], change, role)
                pipe.multi()
                if changed:
                    pipe.hset(keys.pool_targets, mapping={r: pack(t) for r, t in changed.items()})
                await pipe.execute()
                break
            except WatchError:
                continue
    return {"targets": {r: asdict(t) for r, t in sorted(targets.items())}}


@pools_api.get("/cluster/pools")
async def pools(request: Request) -> dict[str, Any]:
    redis, keys = _keys(request)
    controller = await read_controller(redis, keys)
    return {"targets": {r: asdict(t) for r, t in (await read_targets(redis, keys)).items()},
            "controller": None if controller is None else
            {"pid": controller.pid, "starting": controller.starting, "draining": controller.draining}}


@pools_api.get("/cluster/config")
async def running_config(request: Request) -> JSONResponse:
    redis, keys = _keys(request)
    controller = await _require_controller(redis, keys)
    return JSONResponse(controller.config)
