"""Which decode worker a request lands on, over real HTTP with services in this process (p0, d0, d1): a
conversation's next turn stays on the decode worker caching its earlier turns while that worker is within
``decode_affinity_slack`` of the least busy one, and prefills there; a ``prompt_cache_key`` puts unrelated
prompts on the worker it ranks first. (The rules on hand-made views: test_policy.py.)"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest

from router.policy import PolicyConfig, key_rank
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient
from tests.router.conftest import MODEL
from tests.router.serve import AppServer, serve_router
from workers.service.base import EngineService
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.service.publisher import PublishConfig
from workers.transport.tcp import TcpTransport

DECODERS = ("d0", "d1")


def started(services: dict[str, EngineService]) -> dict[str, int]:
    return {name: s.num_requests_started for name, s in services.items()}


def landed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The workers that took a request between two counts (one name per request)."""
    return [name for name in before for _ in range(after[name] - before[name])]


def settle(url: str, quiet_s: float = 0.3) -> None:
    """Until every worker's load report has said for ``quiet_s`` that it runs nothing and holds no block for a
    request: then the workers' loads tie. Once is not enough: a report read during the last request can reach
    the router after one read before it (the publisher reads the load, then writes it), and the routing of the
    next request then saw that worker busy (the test failed so, 1 run in 3 on a 2-core host)."""
    deadline = time.monotonic() + 10
    quiet_since = None
    while True:
        now = time.monotonic()
        busy = any(w["num_running"] or w["num_waiting"] or w["kv_blocks_used"]
                   for w in httpx.get(f"{url}/cluster/status").json()["workers"])
        quiet_since = None if busy else (quiet_since or now)
        if quiet_since is not None and now - quiet_since >= quiet_s:
            return
        assert now < deadline, "the workers still report requests"
        time.sleep(0.05)


def complete(url: str, prompt: list[int], max_tokens: int = 4, **fields: object) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text


@pytest.fixture
def cluster(make_engine, redis_url) -> Iterator[Callable[..., tuple[AppServer, dict[str, EngineService]]]]:
    """``start(slack, policy)``: p0, d0 and d1, and a router of that policy and decode affinity slack (None: under
    least_loaded and round_robin, which read no slack)."""
    made: list[tuple[AppServer, list[EngineService]]] = []

    def start(slack: int | None, policy: str = "prefix_aware") -> tuple[AppServer, dict[str, EngineService]]:
        publish = PublishConfig(redis_url, f"affinity-{uuid.uuid4().hex[:8]}")
        prefill = PrefillService(make_engine(), TcpTransport(), "p0", publish=publish).start()
        decoders = {name: DecodeService(make_engine(), TcpTransport(), name, LocalPrefillClient({"p0": prefill}),
                                        transfer_timeout_s=10.0, publish=publish).start() for name in DECODERS}
        # Short prompts are prefilled remotely too: only a cached prefix makes a prefill local. (The other
        # policies never prefill locally nor read the slack, and refuse both knobs.)
        policy_config = (PolicyConfig(policy) if slack is None
                         else PolicyConfig(policy, local_prefill_max_tokens=8, decode_affinity_slack=slack))
        config = RouterConfig(redis_url, publish.cluster, served_model_name=MODEL, policy=policy_config)
        client = LocalWorkerClient(dict(decoders), {"p0": prefill})
        router = serve_router(config, client, decoders["d0"].loop.engine.tokenizer, min_workers=3)
        made.append((router, [prefill, *decoders.values()]))
        return router, {"p0": prefill, **decoders}

    yield start
    for router, services in made:
        router.stop()
        for service in services:
            service.close()


@pytest.mark.parametrize("slack", [4, 0])
def test_a_conversation_stays_on_the_decode_worker_caching_it(cluster, slack):
    router, services = cluster(slack)
    rng = random.Random(slack)
    settle(router.url)
    history = [rng.randrange(100, 40000) for _ in range(300)]
    before = started(services)
    complete(router.url, history)  # the first turn: remote prefill on p0, decoded on one of d0, d1
    [home] = [w for w in landed(before, started(services)) if w != "p0"]
    other = next(w for w in DECODERS if w != home)
    # A long request on the same history keeps home one request busier than the other while turn 2 arrives.
    first_chunk, done = threading.Event(), threading.Event()

    def busy() -> None:
        body = {"model": MODEL, "prompt": history + [11] * 8, "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as response:
            for _ in response.iter_lines():
                first_chunk.set()
        done.set()

    settle(router.url)
    before = started(services)
    threading.Thread(target=busy, daemon=True).start()
    assert first_chunk.wait(60)
    # It shares 288 of its 308 tokens with what home caches, and the load ties: home takes it, and prefills it.
    assert landed(before, started(services)) == [home]
    before = started(services)
    complete(router.url, history + [rng.randrange(100, 40000) for _ in range(40)])  # turn 2: 340 tokens
    assert not done.is_set(), "the long request ended before turn 2 was routed"
    if slack:  # home caches 288 of them (85%): decoded there, and prefilled there (nothing from p0)
        assert landed(before, started(services)) == [home]
    else:  # load alone: the idle worker, which needs the whole prompt from p0
        assert landed(before, started(services)) == ["p0", other]
    assert done.wait(120)


def test_prompt_cache_key_puts_unrelated_prompts_on_its_first_worker(cluster):
    router, services = cluster(4)
    rng = random.Random(7)
    homes = {}
    for key in [f"conversation-{i}" for i in range(6)]:
        home = max(DECODERS, key=lambda w: key_rank(key, w))
        for _ in range(3):  # prompts with nothing in common: only the key relates them
            # Idle by the reports too: a report still counting the last request as waiting puts its worker
            # behind the other whatever the key (the test failed so once).
            settle(router.url)
            before = started(services)
            complete(router.url, [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 80))],
                     prompt_cache_key=key)
            assert [w for w in landed(before, started(services)) if w != "p0"] == [home], key
        homes[key] = home
    assert set(homes.values()) == set(DECODERS)  # the keys spread over both
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "prompt_cache_key": "conversation-0"}
    before = started(services)
    response = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60)
    assert response.status_code == 200, response.text
    assert landed(before, started(services))[-1] == homes["conversation-0"]


def test_under_least_loaded_prompt_cache_key_breaks_the_ties(cluster):
    """The policy that ignores caches still honours the key where the load ties: one key's requests, one worker."""
    router, services = cluster(None, "least_loaded")
    rng = random.Random(3)
    homes = set()
    for key in [f"agent-{i}" for i in range(6)]:
        served = set()
        for _ in range(3):
            settle(router.url)  # idle by the reports too: a tie
            before = started(services)
            complete(router.url, [rng.randrange(100, 40000) for _ in range(40)], prompt_cache_key=key)
            served |= {w for w in landed(before, started(services)) if w != "p0"}
        assert len(served) == 1, (key, served)
        homes |= served
    assert homes == set(DECODERS)
