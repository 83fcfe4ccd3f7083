"""Mid-stream failover with services in this process: the decode worker holding four streams stops after
each has sent 8 tokens; every stream goes on from another decode worker (which joined meanwhile) with the
text an undisturbed run gives, and the client sees one uninterrupted stream. (With Ray actors and
SIGKILL: tests/workers/test_failover_ray.py.)"""

from __future__ import annotations

import json
import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.policy import PolicyConfig
from router.state import RouterConfig
from router.worker_client import LocalWorkerClient, WorkerUnreachable
from tests.router.conftest import MODEL
from tests.router.serve import serve_router
from workers.engine.engine import Engine
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.service.publisher import PublishConfig
from workers.transport.tcp import TcpTransport

QUESTIONS = ["Tell me about the moon.", "Why is the sea salty?", "Name three rivers in Europe.",
             "What do bees make?"]
MAX_TOKENS = 24


def stream_chat(url: str, question: str, body: dict, progress: list[int], out: dict) -> None:  # type: ignore[type-arg]
    """One streamed chat; ``progress`` counts content events, ``out`` gets the text and any error event."""
    text, errors = "", []
    request = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS,
               "stream": True, **body}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=request, timeout=120) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            for choice in event["choices"]:
                text += choice["delta"].get("content") or ""
                progress[0] += 1
    out.update(text=text, errors=errors, status=response.status_code)


@pytest.fixture
def two_decoders(make_engine, redis_url):
    """p0 and d0 up; d1 is started by the test (so that the streams all land on d0 first)."""
    cluster = f"failover-{uuid.uuid4().hex[:8]}"
    publish = PublishConfig(redis_url, cluster)
    prefill = PrefillService(make_engine(dense=True), TcpTransport(), "p0", publish=publish).start()
    services: dict[str, DecodeService] = {}

    def start_decoder(name: str, engine: Engine | None = None) -> DecodeService:
        services[name] = DecodeService(engine or make_engine(dense=True), TcpTransport(), name, LocalPrefillClient(
            {"p0": prefill}), transfer_timeout_s=10.0, publish=publish).start()
        client.decode[name] = client.services[name] = services[name]
        return services[name]

    client = LocalWorkerClient({}, {"p0": prefill})
    start_decoder("d0")
    config = RouterConfig(redis_url, cluster, served_model_name=MODEL,
                          policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
    router = serve_router(config, client, services["d0"].loop.engine.tokenizer, min_workers=2)
    yield router, start_decoder, services
    router.stop()
    for service in [*services.values(), prefill]:
        service.close()


@pytest.mark.parametrize("body", [{"temperature": 0}, {"temperature": 1.0, "seed": 5, "frequency_penalty": 0.4}],
                         ids=["greedy", "seeded"])
def test_streams_go_on_from_another_decode_worker(two_decoders, make_engine, body):
    router, start_decoder, services = two_decoders
    engine = make_engine(dense=True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=body["temperature"], seed=body.get("seed"),
                            frequency_penalty=body.get("frequency_penalty", 0.0))
    want = [engine.generate([{"messages": [{"role": "user", "content": q}]}], params)[0].text for q in QUESTIONS]
    spare = make_engine(dense=True)
    progress = [[0] for _ in QUESTIONS]
    outs: list[dict] = [{} for _ in QUESTIONS]  # type: ignore[type-arg]
    threads = [threading.Thread(target=stream_chat, args=(router.url, q, body, progress[i], outs[i]))
               for i, q in enumerate(QUESTIONS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while min(p[0] for p in progress) < 8:
        assert time.monotonic() < deadline and all(t.is_alive() for t in threads), progress
        time.sleep(0.01)
    start_decoder("d1", spare)  # its engine built beforehand: building one (~2.5 s here) outlasted the streams
    services["d0"].close()  # every stream was on d0: it held the only decode worker
    for t in threads:
        t.join(timeout=120)
    metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
    assert [o["errors"] for o in outs] == [[]] * 4 and [o["status"] for o in outs] == [200] * 4
    assert [o["text"] for o in outs] == want
    # "unavailable" (its stream said it stopped) or, where the stop wins the race, "unreachable": 4 in all
    failovers = {s.labels["reason"]: s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                 if s.name == "tandem_router_failovers_total"}
    assert sum(failovers.values()) == 4 and set(failovers) <= {"unavailable", "unreachable"}, failovers
    assert services["d1"].loop.call(lambda e: e.stats().prefill_tokens_total).result(timeout=10) > 0


def test_failover_is_bounded_then_one_error_event(two_decoders):
    """No other decode worker comes: after the wait, the stream ends with one error event."""
    router, _, services = two_decoders
    router.app.state.router.dispatcher.failover_wait_s = 2.0
    progress, out = [0], {}
    thread = threading.Thread(target=stream_chat, args=(router.url, QUESTIONS[0], {"temperature": 0}, progress,
                                                        out))
    thread.start()
    while progress[0] < 4:
        time.sleep(0.01)
    services["d0"].close()
    thread.join(timeout=60)
    assert out["status"] == 200 and len(out["errors"]) == 1
    assert "no decode worker" in out["errors"][0]["message"]


def test_a_worker_that_dies_after_its_last_chunk_ends_nothing(two_decoders):
    """Seen in a chaos run: a decode worker killed right after sending a stream's last chunk; the router read on,
    saw the death, and tried to resume a request that had all its tokens (an error event after the end)."""
    router, _, _ = two_decoders
    client = router.app.state.router.dispatcher.client
    generate = client.generate

    async def dies_after_the_end(decode_worker, request):  # type: ignore[no-untyped-def]
        async for chunk in generate(decode_worker, request):
            yield chunk
        raise WorkerUnreachable(f"decode worker {decode_worker!r} died")

    client.generate = dies_after_the_end
    progress, out = [0], {}
    stream_chat(router.url, QUESTIONS[1], {"temperature": 0}, progress, out)
    assert out["status"] == 200 and out["errors"] == [] and progress[0] > 0
    metrics = httpx.get(f"{router.url}/metrics", timeout=30).text
    assert not [s for f in text_string_to_metric_families(metrics) for s in f.samples
                if s.name == "tandem_router_failovers_total" and s.value > 0]  # nothing was resumed
