"""Prefill and decode services in one process, KV over a real transport (tcp), no Ray.

Outputs must equal a single engine's; every exit path (finish, cancel in either phase, failed
transfer) must leave no block held by a request on either side.

On the dense model: greedy tokens are compared across batchings, and the quantized path rounds a step's
tokens differently when it holds more than 96 (kernels/quant_linear.py)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tests.prompts import text_of_tokens
from workers.protocol.messages import GenerateRequest, TokenChunk
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.transport.tcp import TcpTransport

GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


@pytest.fixture
def cluster(make_engine):
    """One prefill service 'p0' and one decode service 'd0'."""
    prefill = PrefillService(make_engine(dense=True), TcpTransport(), "p0").start()
    decode = DecodeService(make_engine(dense=True), TcpTransport(), "d0", LocalPrefillClient({"p0": prefill}),
                           transfer_timeout_s=5.0).start()
    yield prefill, decode
    decode.close()
    prefill.close()


def request(engine, rid: str, prompt, params: SamplingParams = GREEDY, prefill: str | None = "p0") -> GenerateRequest:
    return GenerateRequest(rid, engine.tokenize(prompt), params, None, prefill)


async def collect(decode: DecodeService, req: GenerateRequest) -> list[TokenChunk]:
    return [chunk async for chunk in decode.generate(req)]


def held_blocks(service) -> int:  # type: ignore[no-untyped-def]
    """Blocks held by requests (evictable prefix cache does not count), read on the engine thread."""
    return service.loop.call(lambda e: e.block_pool.num_used_blocks).result(timeout=10)


def test_remote_and_local_prefill_match_a_single_engine(cluster, make_engine):
    prefill, decode = cluster
    single = make_engine(dense=True)
    prompts = [text_of_tokens(single.tokenizer, n, seed=n) for n in (5, 40, 130, 300)]
    expected = single.generate(prompts, GREEDY)

    async def run():
        reqs = [request(single, f"r{i}", p, prefill="p0" if i % 2 == 0 else None) for i, p in enumerate(prompts)]
        return await asyncio.gather(*(collect(decode, r) for r in reqs))

    for chunks, want in zip(asyncio.run(run()), expected, strict=True):
        assert chunks[-1].finished and chunks[-1].error is None
        assert [t for c in chunks for t in c.token_ids] == want.token_ids
        assert "".join(c.text for c in chunks) == want.text
    assert held_blocks(prefill) == held_blocks(decode) == 0
    assert b"tandem_kv_transfer_bytes_total" in prefill.metrics.exposition()


def test_cancel_while_decoding_frees_decode_blocks(cluster):
    prefill, decode = cluster
    engine = decode.loop.engine

    async def run():
        stream = decode.generate(request(engine, "c1", "Tell me a story", SamplingParams(max_tokens=200,
                                                                                      ignore_eos=True)))
        got = [await anext(stream) for _ in range(3)]
        await stream.aclose()
        return got

    assert len(asyncio.run(run())) == 3
    assert held_blocks(decode) == 0 and held_blocks(prefill) == 0


def test_cancel_while_prefilling_frees_both_sides(cluster):
    prefill, decode = cluster
    engine = decode.loop.engine
    long_prompt = text_of_tokens(engine.tokenizer, 1500, seed=9)

    async def run():
        task = asyncio.ensure_future(collect(decode, request(engine, "c2", long_prompt)))
        while (await prefill.load()).num_running == 0:  # the prefill worker has started on it
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert held_blocks(decode) == 0 and held_blocks(prefill) == 0


def test_failed_transfer_ends_the_stream_with_an_error_and_frees_blocks(cluster, make_engine):
    prefill, decode = cluster
    engine = decode.loop.engine
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: the transfer is refused
    decode.transport.address = lambda: {"backend": "tcp", "host": "127.0.0.1", "port": port}  # type: ignore[method-assign]

    chunks = asyncio.run(collect(decode, request(engine, "f1", "Hello there, how are you?")))
    assert chunks[-1].finished and chunks[-1].error_kind == "transfer"
    assert "failed" in (chunks[-1].error or "")
    assert held_blocks(decode) == 0 and held_blocks(prefill) == 0

    del decode.transport.address  # the prefill worker keeps serving
    chunks = asyncio.run(collect(decode, request(engine, "f2", "Hello there, how are you?")))
    assert chunks[-1].error is None and chunks[-1].num_output_tokens == GREEDY.max_tokens


def test_bad_request_is_an_error_chunk(cluster):
    _, decode = cluster
    bad = GenerateRequest("b1", [1, 2, 10**9], SamplingParams(max_tokens=4), None, "p0")
    (chunk,) = asyncio.run(collect(decode, bad))
    assert chunk.error_kind == "invalid_request" and "token ids" in (chunk.error or "")
    assert held_blocks(decode) == 0
