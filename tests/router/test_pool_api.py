"""Pool targets over a router's HTTP API, on a real Redis; the controller is played by the test
(its heartbeat key), the real one is exercised by tests/cluster/test_scale.py."""

from __future__ import annotations

import uuid

import httpx
import pytest
import redis

from router.app import create_app
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient
from tests.router.serve import serve_app
from workers.protocol.cluster_keys import ClusterKeys, ControllerState, PoolTarget
from workers.protocol.messages import pack, unpack


@pytest.fixture(scope="module")
def router(redis_url, default_model_and_tokenizer):
    _, tokenizer = default_model_and_tokenizer
    cluster = f"pools-{uuid.uuid4().hex[:8]}"
    served = serve_app(create_app(RouterConfig(redis_url, cluster), LocalWorkerClient({}), tokenizer))
    yield served, ClusterKeys(cluster), redis.Redis.from_url(redis_url)
    served.stop()


@pytest.fixture
def controller(router):
    """A stand-in controller: its heartbeat and the targets ``tandem serve`` would write."""
    _, keys, r = router
    r.hset(keys.pool_targets, mapping={"prefill": pack(PoolTarget(1, 1, 4)), "decode": pack(PoolTarget(1, 1, 4))})
    config = {"name": keys.cluster, "decode": {"replicas": 1}}
    r.set(keys.controller, pack(ControllerState(1234, config, [], ["decode-3"])), px=60_000)
    yield keys, r
    r.delete(keys.pool_targets, keys.controller)


def targets(r: redis.Redis, keys: ClusterKeys) -> dict[str, PoolTarget]:
    return {k.decode(): unpack(PoolTarget, v) for k, v in r.hgetall(keys.pool_targets).items()}


def test_scale_writes_the_target_the_controller_reads(router, controller):
    served, _, _ = router
    keys, r = controller
    reply = httpx.post(f"{served.url}/cluster/scale", json={"decode": {"replicas": 3}})
    assert reply.status_code == 202
    assert reply.json()["targets"]["decode"] == {"replicas": 3, "min_replicas": 1, "max_replicas": 4}
    assert targets(r, keys) == {"prefill": PoolTarget(1, 1, 4), "decode": PoolTarget(3, 1, 4)}
    reply = httpx.post(f"{served.url}/cluster/scale",
                       json={"prefill": {"replicas": 6, "max_replicas": 8}, "decode": {"replicas": 1}})
    assert reply.status_code == 202
    assert targets(r, keys) == {"prefill": PoolTarget(6, 1, 8), "decode": PoolTarget(1, 1, 4)}
    pools = httpx.get(f"{served.url}/cluster/pools").json()
    assert pools["controller"] == {"pid": 1234, "starting": [], "draining": ["decode-3"]}
    assert pools["targets"]["prefill"]["replicas"] == 6
    status = httpx.get(f"{served.url}/cluster/status").json()
    assert status["targets"] == {"prefill": 6, "decode": 1} and status["draining"] == ["decode-3"]
    assert httpx.get(f"{served.url}/cluster/config").json() == {"name": keys.cluster, "decode": {"replicas": 1}}
    metrics = httpx.get(f"{served.url}/metrics").text
    for line in ('tandem_router_pool_target_workers{role="prefill"} 6.0',
                 'tandem_router_pool_target_workers{role="decode"} 1.0',
                 'tandem_router_pool_changing_workers{state="draining"} 1.0',
                 'tandem_router_pool_changing_workers{state="starting"} 0.0'):
        assert line in metrics.splitlines(), metrics


@pytest.mark.parametrize("body, param, words", [
    ({"decode": {"replicas": 5}}, "decode.replicas", "outside the pool's bounds [1, 4]"),
    ({"decode": {"replicas": 0}}, "decode.replicas", "outside the pool's bounds [1, 4]"),
    ({"prefill": {"min_replicas": 5}}, "prefill.min_replicas", "exceeds max_replicas (4)"),
    ({"decode": {"replicas": -1}}, "decode.replicas", "greater than or equal to 0"),
    ({"decode": {"replicas": "2"}}, "decode.replicas", "valid integer"),
    ({"decode": {"replicas": 1.5}}, "decode.replicas", "valid integer"),
    ({"decoder": {"replicas": 1}}, "decoder", "Unrecognized request argument supplied: decoder"),
    ({"decode": {"replica": 1}}, "decode.replica", "Unrecognized request argument supplied: decode.replica"),
])
def test_bad_scales_are_400_naming_the_field_and_change_nothing(router, controller, body, param, words):
    served, _, _ = router
    keys, r = controller
    reply = httpx.post(f"{served.url}/cluster/scale", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert targets(r, keys) == {"prefill": PoolTarget(1, 1, 4), "decode": PoolTarget(1, 1, 4)}


def test_without_a_controller_scale_is_503_and_status_still_answers(router):
    served, _, _ = router
    reply = httpx.post(f"{served.url}/cluster/scale", json={"decode": {"replicas": 2}})
    assert reply.status_code == 503 and reply.headers["Retry-After"] == "5"
    assert "no pool controller" in reply.json()["error"]["message"]
    assert httpx.get(f"{served.url}/cluster/config").status_code == 503
    assert httpx.get(f"{served.url}/cluster/pools").json() == {"targets": {}, "controller": None}
    status = httpx.get(f"{served.url}/cluster/status").json()
    assert status["targets"] == {} and status["starting"] == [] and status["draining"] == []
