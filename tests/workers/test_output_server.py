"""A decode worker's output channels over TCP (workers/service/output_server.py), read as a router reads them: a
frame a step with the per-request streams' outputs; the router closing its end, or reading nothing past the stall
timeout, closes the channel and frees its requests; a second connection for a live channel id and one that never
says hello are refused."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import pytest

from tests.prompts import text_of_tokens
from tests.workers.test_output_channel import assert_all_freed, channel_metrics, each_requests_tokens, tokens_alone
from workers.protocol.frames import read_frame, write_frame
from workers.protocol.messages import GenerateRequest, TokenChunk, unpack_list
from workers.protocol.sampling_params import SamplingParams
from workers.service.output_server import OutputServer

pytestmark = pytest.mark.asyncio


async def connect(address: tuple[str, int], channel_id: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*address)
    write_frame(writer, channel_id.encode())
    return reader, writer


async def next_batch(reader: asyncio.StreamReader) -> list[TokenChunk] | None:
    data = await asyncio.wait_for(read_frame(reader), 60)
    return None if data is None else unpack_list(TokenChunk, data)


async def test_a_routers_connection_carries_its_requests_outputs_a_frame_a_step(decode, make_engine):
    tokenizer = make_engine(dense=True).tokenizer
    prompts = [tokenizer.encode(text_of_tokens(tokenizer, n, seed=300 + n)) for n in (12, 40, 90)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    alone = await tokens_alone(decode, prompts, params)
    server = OutputServer(decode, "127.0.0.1")
    address = await server.start()
    assert await server.start() == address  # one listener
    reader, writer = await connect(address, "router-1")
    assert await next_batch(reader) == []  # attached: requests may start
    for i, p in enumerate(prompts):
        decode.start_on("router-1", GenerateRequest(f"c{i}", p, params))
    tokens, frames = await each_requests_tokens(lambda: next_batch(reader), len(prompts))
    assert tokens == alone
    assert frames < sum(map(len, alone)) / 2  # a frame a step for all three, not one a token

    # A second connection for the same channel is refused; the first carries on.
    other_reader, other_writer = await connect(address, "router-1")
    assert await next_batch(other_reader) is None
    other_writer.close()
    # The router closes its end while nothing streams: the worker hears it at once (not at the channel's TTL).
    writer.close()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if not decode.renew_channel("router-1"):
            break
    assert not decode.renew_channel("router-1")
    # ... and with a request mid-way: the request is aborted and freed.
    reader, writer = await connect(address, "router-2")
    assert await next_batch(reader) == []
    decode.start_on("router-2", GenerateRequest("orphan", prompts[2], SamplingParams(max_tokens=400, ignore_eos=True)))
    assert await next_batch(reader)
    writer.close()
    await assert_all_freed(decode)
    assert channel_metrics(decode) == (0, 0)  # left, not expired
    server.close()


async def test_a_connection_that_never_says_hello_is_closed():
    server = OutputServer(NeverCalled(), "127.0.0.1", hello_timeout_s=0.2)
    reader, _ = await asyncio.open_connection(*await server.start())
    assert await asyncio.wait_for(read_frame(reader), 10) is None
    server.close()


async def test_a_router_that_reads_nothing_past_the_stall_timeout_loses_its_channel():
    """Its buffers full, the worker's next write waits: past the stall timeout the channel closes (its requests
    are cancelled) instead of piling up chunks for a router that may never read again."""
    service = Flood()
    server = OutputServer(service, "127.0.0.1", stall_timeout_s=0.3)
    reader, writer = await connect(await server.start(), "router-1")
    assert await next_batch(reader) == []  # then reads no more
    await asyncio.wait_for(service.closed.wait(), 30)
    writer.close()
    server.close()


class NeverCalled:
    def subscribe(self, channel_id: str) -> AsyncGenerator[list[TokenChunk], None]:
        raise AssertionError("no hello, no channel")


class Flood:
    """A channel whose requests make 64 KB chunks as fast as they can be written."""

    def __init__(self) -> None:
        self.closed = asyncio.Event()

    async def subscribe(self, channel_id: str) -> AsyncGenerator[list[TokenChunk], None]:
        try:
            yield []
            while True:
                yield [TokenChunk("r", [1], "x" * 65536)]
        finally:
            self.closed.set()
