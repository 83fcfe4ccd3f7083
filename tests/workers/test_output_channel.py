"""A router's requests on one output stream (workers/service/output_channel.py): chunks batched per wake-up in each
request's order, cancels and a consumer that leaves reaching every request, failures ending a request with an error
chunk; then the same on a decode service's real engine, whose outputs must equal its per-request streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

import pytest

from tests.prompts import text_of_tokens
from workers.protocol.messages import GenerateRequest, TokenChunk
from workers.protocol.sampling_params import SamplingParams
from workers.service.decode import DecodeService
from workers.service.output_channel import ChannelClosed, OutputChannel

pytestmark = pytest.mark.asyncio


class FakeStream:
    """A request's stream: yields its chunks when told to (``step``), records being closed."""

    def __init__(self, rid: str, length: int, fail_at: int | None = None, last_finished: bool = True):
        self.rid, self.length, self.fail_at, self.last_finished = rid, length, fail_at, last_finished
        self.go = asyncio.Queue[None]()
        self.closed = False

    async def chunks(self) -> AsyncGenerator[TokenChunk, None]:
        try:
            for i in range(self.length):
                await self.go.get()
                if i == self.fail_at:
                    raise RuntimeError("engine broke")
                yield TokenChunk(self.rid, [i], finished=self.last_finished and i == self.length - 1)
        finally:
            self.closed = True


async def drain_ready() -> None:
    for _ in range(10):  # let every woken task run
        await asyncio.sleep(0)


async def test_each_wake_up_is_one_batch_in_each_requests_order():
    channel = OutputChannel()
    batches = channel.batches()
    assert await anext(batches) == []  # attached
    streams = [FakeStream(f"r{i}", 3) for i in range(4)]
    for s in streams:
        channel.start(s.rid, s.chunks())
    got: list[list[TokenChunk]] = []
    for _ in range(3):  # a "decode step": every request makes a chunk at once
        for s in streams:
            s.go.put_nowait(None)
        got.append(await anext(batches))
    assert [[c.request_id for c in b] for b in got] == [["r0", "r1", "r2", "r3"]] * 3
    assert all(c.token_ids == [step] for step, b in enumerate(got) for c in b)
    assert [c.finished for c in got[-1]] == [True] * 4
    await drain_ready()
    assert channel.num_requests == 0 and all(s.closed for s in streams)
    # Two steps' chunks before the consumer reads: one batch, each request's chunks in order.
    late = FakeStream("late", 2)
    channel.start(late.rid, late.chunks())
    late.go.put_nowait(None)
    late.go.put_nowait(None)
    await drain_ready()
    assert [(c.request_id, c.token_ids) for c in await anext(batches)] == [("late", [0]), ("late", [1])]
    await batches.aclose()


async def test_cancel_closes_that_request_alone():
    channel = OutputChannel()
    batches = channel.batches()
    await anext(batches)
    keep, drop = FakeStream("keep", 2), FakeStream("drop", 5)
    channel.start("keep", keep.chunks())
    channel.start("drop", drop.chunks())
    await drain_ready()  # both running
    assert channel.cancel("drop")
    await drain_ready()
    assert drop.closed and not keep.closed and channel.num_requests == 1
    assert not channel.cancel("drop")  # ended: nothing to cancel
    keep.go.put_nowait(None)
    keep.go.put_nowait(None)
    await drain_ready()
    assert [c.request_id for c in await anext(batches)] == ["keep", "keep"]
    await batches.aclose()


async def test_a_consumer_that_leaves_cancels_every_request_and_closes_the_channel():
    channel = OutputChannel()
    batches = channel.batches()
    await anext(batches)
    streams = [FakeStream(f"r{i}", 100) for i in range(3)]
    for s in streams:
        channel.start(s.rid, s.chunks())
    await drain_ready()
    await batches.aclose()
    await drain_ready()
    assert all(s.closed for s in streams) and channel.num_requests == 0
    with pytest.raises(ChannelClosed):
        channel.start("after", FakeStream("after", 1).chunks())


async def test_a_channel_its_consumer_stops_renewing_closes_and_cancels_its_requests():
    """A dead router says nothing: its channel ends ttl_s after the last renewal, and its requests with it."""
    channel = OutputChannel(ttl_s=0.3)
    batches = channel.batches()
    await anext(batches)
    stream = FakeStream("r", 100)
    channel.start("r", stream.chunks())
    for _ in range(12):  # 0.6 s, renewed: still open
        await asyncio.sleep(0.05)
        assert channel.renew()
    assert not stream.closed and not channel.expired
    t0 = asyncio.get_running_loop().time()
    with pytest.raises(StopAsyncIteration):
        await asyncio.wait_for(anext(batches), 2)  # ends: unrenewed past 0.3 s
    assert 0.25 < asyncio.get_running_loop().time() - t0 < 1.0
    await drain_ready()
    assert stream.closed and not channel.renew() and channel.expired


async def test_a_failing_or_unfinished_stream_ends_with_an_error_chunk():
    channel = OutputChannel()
    batches = channel.batches()
    await anext(batches)
    broken, short = FakeStream("broken", 3, fail_at=1), FakeStream("short", 1, last_finished=False)
    channel.start("broken", broken.chunks())
    channel.start("short", short.chunks())
    with pytest.raises(ValueError, match="already streaming"):
        channel.start("short", FakeStream("short", 1).chunks())
    for s in (broken, broken, short):
        s.go.put_nowait(None)
    chunks: list[TokenChunk] = []
    while len(chunks) < 4:
        chunks += await anext(batches)
    by_rid = {rid: [c for c in chunks if c.request_id == rid] for rid in ("broken", "short")}
    assert [c.finished for c in by_rid["broken"]] == [False, True]
    assert by_rid["broken"][-1].error == "RuntimeError: engine broke" and by_rid["broken"][-1].error_kind == "internal"
    assert by_rid["short"][-1].finished and "without a last chunk" in (by_rid["short"][-1].error or "")
    await batches.aclose()


def held_blocks(service: DecodeService) -> int:
    return service.loop.call(lambda e: e.block_pool.num_used_blocks).result(timeout=10)


async def assert_all_freed(service: DecodeService) -> None:
    """Within 10 s, no request is in flight and no KV block is held."""
    for _ in range(200):
        if held_blocks(service) == 0 and service.num_in_flight() == 0:
            break
        await asyncio.sleep(0.05)
    assert held_blocks(service) == 0 and service.num_in_flight() == 0


async def tokens_alone(decode: DecodeService, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Each prompt's tokens streamed on its own (``generate``), one after another."""
    return [[t async for c in decode.generate(GenerateRequest(f"a{i}", p, params)) for t in c.token_ids]
            for i, p in enumerate(prompts)]


async def each_requests_tokens(next_batch: Callable[[], Awaitable[list[TokenChunk] | None]],
                               count: int) -> tuple[list[list[int]], int]:
    """Requests c0 .. c{count - 1}'s tokens, from batches until each has finished (none with an error), and the
    number of batches that took."""
    tokens: dict[str, list[int]] = {f"c{i}": [] for i in range(count)}
    done: set[str] = set()
    batches = 0
    while len(done) < count:
        batch = await next_batch()
        assert batch is not None
        batches += 1
        for chunk in batch:
            assert chunk.error is None, chunk.error
            tokens[chunk.request_id] += chunk.token_ids
            if chunk.finished:
                done.add(chunk.request_id)
    return [tokens[f"c{i}"] for i in range(count)], batches


async def test_a_services_channel_gives_its_per_request_streams_outputs_and_frees_on_cancel(decode, make_engine):
    tokenizer = make_engine(dense=True).tokenizer
    prompts = [tokenizer.encode(text_of_tokens(tokenizer, n, seed=n)) for n in (12, 40, 90, 150)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = await tokens_alone(decode, prompts, params)

    subscription = decode.subscribe("router-1")
    assert await anext(subscription) == []
    assert channel_metrics(decode) == (1, 0)
    with pytest.raises(ChannelClosed, match="no output channel 'nobody'"):
        decode.start_on("nobody", GenerateRequest("x", prompts[0], params))
    for i, p in enumerate(prompts):
        decode.start_on("router-1", GenerateRequest(f"c{i}", p, params))

    async def next_batch() -> list[TokenChunk]:
        batch = await asyncio.wait_for(anext(subscription), 60)
        assert decode.renew_channel("router-1")  # as a live router does (unrenewed for 15 s, it would expire)
        return batch

    tokens, batches = await each_requests_tokens(next_batch, len(prompts))
    assert tokens == alone
    assert batches < sum(map(len, alone)) / 2  # a batch a step for all four, not an item a token

    # A cancel, then the consumer leaving: the requests are aborted and their blocks freed.
    long = SamplingParams(max_tokens=400, ignore_eos=True)
    decode.start_on("router-1", GenerateRequest("cancelled", prompts[3], long))
    decode.start_on("router-1", GenerateRequest("orphan", prompts[2], long))
    await asyncio.wait_for(anext(subscription), 60)
    assert decode.cancel_on("router-1", "cancelled")
    assert not decode.cancel_on("router-2", "orphan")  # another router's channel does not reach it
    await subscription.aclose()
    await assert_all_freed(decode)
    with pytest.raises(ChannelClosed):
        decode.start_on("router-1", GenerateRequest("late", prompts[0], params))
    assert channel_metrics(decode) == (0, 0)  # left, not expired

    # A router that stops renewing (dead): its channel expires, its request is aborted, the operator sees it.
    subscription = decode.subscribe("router-3")
    await anext(subscription)
    decode._channels["router-3"].ttl_s = 0.3  # (the default 15 s, shortened before the channel's first wait)
    decode.start_on("router-3", GenerateRequest("unheard", prompts[1], long))
    with pytest.raises(StopAsyncIteration):
        while True:
            await asyncio.wait_for(anext(subscription), 60)
    await assert_all_freed(decode)
    assert channel_metrics(decode) == (0, 1)


def channel_metrics(service: DecodeService) -> tuple[float | None, float | None]:
    """(output streams open, output streams expired) as the worker's /metrics says them."""
    labels = {"worker_id": service.worker_id, "role": "decode"}
    return (service.metrics.registry.get_sample_value("tandem_output_channels", labels),
            service.metrics.registry.get_sample_value("tandem_output_channels_expired_total", labels))
