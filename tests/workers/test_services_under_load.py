"""The prefill and decode services when the decode worker's KV pool is too small for what arrives: requests
queue, KV grows as tokens come, preemption recomputes, and the queue's bounds shed with their reason.
On the dense model: greedy tokens are compared across batchings, and the quantized path rounds a step's
tokens differently when it holds more than 96 (kernels/quant_linear.py)."""

from __future__ import annotations

import asyncio
import time

from tests.prompts import text_of_tokens
from tests.workers.test_services import collect, held_blocks
from workers.protocol.messages import GenerateRequest, TokenChunk
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.prefill import PrefillService
from workers.service.prefill_clients import LocalPrefillClient
from workers.transport.tcp import TcpTransport

LONG_GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def serve_all(make_engine, prompts: list[list[int]], decode_blocks: int, **decode_knobs) -> tuple[  # type: ignore[no-untyped-def]
        list[list[TokenChunk]], dict[str, int]]:
    """Every prompt at once, remote-prefilled on p0 into d0; returns each stream and d0's preemptions."""
    prefill = PrefillService(make_engine(dense=True), TcpTransport(), "p0").start()
    decode = DecodeService(make_engine(dense=True, num_kv_blocks=decode_blocks, **decode_knobs), TcpTransport(), "d0",
                           LocalPrefillClient({"p0": prefill}), transfer_timeout_s=10.0).start()
    try:
        async def run() -> list[list[TokenChunk]]:
            requests = [GenerateRequest(f"r{i}", p, LONG_GREEDY, None, "p0") for i, p in enumerate(prompts)]
            return await asyncio.gather(*(collect(decode, r) for r in requests))

        streams = asyncio.run(run())
        assert held_blocks(decode) == 0 and held_blocks(prefill) == 0
        for service in (prefill, decode):
            assert service.loop.call(lambda e: e.block_pool.check_integrity()).result(timeout=10)
        preemptions = decode.loop.call(lambda e: e.stats().preemptions_by_cause).result(timeout=10)
        return streams, preemptions
    finally:
        decode.close()
        prefill.close()


def tokens(stream: list[TokenChunk]) -> list[int]:
    assert stream[-1].finished and stream[-1].error is None, stream[-1]
    return [t for chunk in stream for t in chunk.token_ids]


def test_preemption_across_the_handoff_keeps_every_greedy_token(make_engine):
    """16 concurrent remote prefills into a decode pool with room for about three at full length."""
    tokenizer = make_engine(dense=True).tokenizer
    prompts = [tokenizer.encode(text_of_tokens(tokenizer, 40 + 3 * i, seed=100 + i)) for i in range(16)]
    roomy, _ = serve_all(make_engine, prompts, decode_blocks=1024)
    tight, preemptions = serve_all(make_engine, prompts, decode_blocks=20)
    assert preemptions.get("decode", 0) > 0  # the pool really ran dry while tokens grew
    assert [tokens(s) for s in tight] == [tokens(s) for s in roomy]
    assert all(len(tokens(s)) == LONG_GREEDY.max_tokens for s in roomy)


def test_the_queue_bounds_shed_with_their_reason_and_leak_nothing(make_engine):
    tokenizer = make_engine(dense=True).tokenizer
    prompts = [tokenizer.encode(text_of_tokens(tokenizer, 40, seed=200 + i)) for i in range(6)]
    # Room for one request at a time, two may wait, and none waits more than 0.3 s.
    streams, _ = serve_all(make_engine, prompts, decode_blocks=7, max_queue_len=2, max_queue_time_s=0.3)
    kinds = [s[-1].error_kind for s in streams]
    assert kinds.count(None) >= 1 and set(kinds) <= {None, "overloaded_queue_full", "overloaded_queue_timeout"}
    assert "overloaded_queue_full" in kinds or "overloaded_queue_timeout" in kinds
    for stream in streams:
        if stream[-1].error_kind is not None:
            assert len(stream) == 1 and "try again" in (stream[-1].error or "")  # shed before any token


def test_queue_time_reaches_the_metrics(make_engine):
    prefill = PrefillService(make_engine(dense=True), TcpTransport(), "p0").start()
    decode = DecodeService(make_engine(dense=True), TcpTransport(), "d0", LocalPrefillClient({"p0": prefill})).start()
    try:
        tokenizer = decode.loop.engine.tokenizer
        request = GenerateRequest("q1", tokenizer.encode("Hello there"), SamplingParams(max_tokens=2), None, None)
        assert asyncio.run(collect(decode, request))[-1].finished
        deadline = time.monotonic() + 5
        while b"tandem_queue_seconds_count" not in decode.metrics.exposition() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = decode.metrics.exposition().decode()
        assert 'tandem_queue_seconds_count{role="decode",worker_id="d0"} 1.0' in text
    finally:
        decode.close()
        prefill.close()
