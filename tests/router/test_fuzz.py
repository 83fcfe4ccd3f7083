"""Issue 22, item 6(c): schemathesis fuzzes a router (real HTTP, real Redis, a prefill and a decode worker on a
tiny random-weight model) from the router's own OpenAPI schema, valid and invalid bodies alike: no answer
may be a 5xx, and every answer must match what the schema says of it. A pool controller's heartbeat is
in Redis, so the cluster endpoints answer as on a running cluster (without one, their 503 is the answer)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator

import pytest
import redis
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import checks

from tests.router.conftest import MODEL, running_cluster
from tests.router.serve import AppServer
from tests.tiny_model import tiny_model
from workers.engine.config import EngineConfig
from workers.engine.engine import Engine
from workers.protocol.cluster_keys import ClusterKeys, ControllerState, PoolTarget
from workers.protocol.messages import pack

# What every answer must be: no 5xx, a documented status, its documented content type and body schema. Not
# "schema-valid input is accepted": the router's rules go past JSON Schema (a tool message needs tool_call_id).
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance]
EXAMPLES = int(os.environ.get("TANDEM_FUZZ_EXAMPLES", "40"))  # per operation; the soak's figure used 1,000


@pytest.fixture(scope="module")
def fuzzed_router(default_model_and_tokenizer, redis_url) -> Iterator[AppServer]:
    _, tokenizer = default_model_and_tokenizer

    def engine() -> Engine:  # the bundled tokenizer's vocabulary over a tiny model: every request is quick
        return Engine(EngineConfig(num_kv_blocks=512, max_model_len=512), model=tiny_model(), tokenizer=tokenizer)

    with running_cluster(redis_url, engine) as (router, _, _):
        keys = ClusterKeys(router.app.state.router.config.cluster)
        store = redis.Redis.from_url(redis_url)
        targets = {"prefill": PoolTarget(1, 0, 4), "decode": PoolTarget(1, 1, 4)}
        store.hset(keys.pool_targets, mapping={r: pack(t) for r, t in targets.items()})
        store.set(keys.controller, pack(ControllerState(os.getpid(), {"name": keys.cluster})), px=3_600_000)
        try:
            yield router
        finally:
            store.delete(keys.controller, keys.pool_targets)


def test_no_request_gets_a_server_error(fuzzed_router):
    """Each operation's cases run as a Hypothesis test of their own (schemathesis' pytest plugin does not load
    under pytest 9): valid and invalid bodies, headers and queries alike."""
    schema = schemathesis.openapi.from_url(f"{fuzzed_router.url}/openapi.json")
    seen: Counter[tuple[str, int]] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/cluster/scale"}
    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        def call(case):  # type: ignore[no-untyped-def]
            if isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, into the engine (a wrong name is one 404)
                if sum(seen.values()) % 2:  # every other request: a plain prompt, so the other fields reach the engine
                    if "messages" in case.body:
                        case.body["messages"] = [{"role": "user", "content": "Say something."}]
                    if "prompt" in case.body:
                        case.body["prompt"] = "Say something."
            response = case.call(timeout=60)
            seen[(case.operation.path, response.status_code)] += 1
            assert response.status_code < 500, (case.method, case.path, case.body, response.status_code,
                                                response.text[:500])
            case.validate_response(response, checks=CHECKS)

        call()
    print(sorted(seen.items()))
    for path in ("/v1/chat/completions", "/v1/completions"):  # the fuzz reached the workers, not only validation
        assert seen[(path, 200)] >= 3, sorted(seen.items())
