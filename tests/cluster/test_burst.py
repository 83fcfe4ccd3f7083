"""A burst of four times what a small cluster serves, from loadgen, against Ray actors behind a router:
every request is served or shed with 429 + Retry-After (never a 5xx), and afterwards every worker's
KV pool is intact with no block held."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from loadgen.client import ClientConfig
from loadgen.metrics import RequestRecord
from loadgen.tokens import TokenText
from loadgen.workload import LengthSpec, WorkloadSpec, build_workload
from workers.engine.config import EngineConfig
from workers.resources import WorkerResources
from workers.service.publisher import PublishConfig

ray = pytest.importorskip("ray")
from loadgen.runner import run_workload  # noqa: E402
from workers.actors import start_decode_worker, start_prefill_worker  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.scenario]
NAMESPACE = "tandem-burst"


@pytest.fixture(scope="module")
def small_cluster(redis_url):
    """1 prefill + 1 decode worker; the decode worker runs 4 requests at once and queues 4 more. KV for
    ~1,450 tokens each; max_model_len 320, so an open-ended chat (no max_tokens) fits and ends soon."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    publish = PublishConfig(redis_url, "burst")
    resources = WorkerResources(num_cpus=1, torch_threads=1)
    kv = {"kv_cache_bytes": 64 << 20, "max_model_len": 320}
    prefill = start_prefill_worker("burst-p0", EngineConfig(**kv, max_queue_len=8, max_queue_time_s=10.0),
                                   resources, "tcp", NAMESPACE, publish)
    decode = start_decode_worker("burst-d0", EngineConfig(**kv, max_num_seqs=4, max_queue_len=4, max_queue_time_s=6.0),
                                 resources, "tcp", NAMESPACE, publish=publish)
    ray.get([w.ready.remote() for w in (prefill, decode)], timeout=300)
    yield prefill, decode
    ray.shutdown()


def test_a_4x_burst_is_served_or_shed_with_429_and_leaves_every_pool_clean(small_cluster, redis_url, make_engine):
    from router.state import RouterConfig
    from router.worker_client import RayWorkerClient
    from tests.router.serve import serve_router

    prefill, decode = small_cluster
    tokenizer = make_engine().tokenizer
    router = serve_router(RouterConfig(redis_url, "burst", served_model_name="smol"), RayWorkerClient(NAMESPACE),
                          tokenizer, min_workers=2)
    try:
        # What this cluster serves depends on the machine: about two requests a second on a Zen 4 (four at
        # a time, ~2 s each), where 8 a second was a 4x burst; on a Zen 5 that many were all served with no
        # queue. 48 requests in one second is four times what either serves. A quarter are open-ended chats
        # (no max_tokens).
        spec = WorkloadSpec(num_requests=48, input_len=LengthSpec.parse("uniform:60:120"),
                            output_len=LengthSpec.parse("16"), rate=48.0, arrival="constant", seed=5,
                            open_ended=0.25)
        workload = build_workload(spec, TokenText(tokenizer.hf))
        records: list[RequestRecord] = []
        cfg = ClientConfig(router.url, "smol", timeout_s=120)
        asyncio.run(run_workload(cfg, workload, records))
    finally:
        router.stop()
    statuses = Counter(r.status for r in records)
    assert set(statuses) <= {200, 429}, [r.error for r in records if r.status not in (200, 429)]
    assert statuses[200] >= 4 and statuses[429] >= 1, statuses
    assert all(r.ok for r in records if r.status == 200), [r.error for r in records if r.status == 200 and not r.ok]
    assert all("try again" in (r.error or "") for r in records if r.status == 429)
    for worker in (prefill, decode):
        assert ray.get(worker.check_integrity.remote(), timeout=30)
        assert ray.get(worker.num_used_blocks.remote(), timeout=30) == 0
