"""The default ``tandem serve`` under the load a chat user brings: many conversations at once, none
with ``max_tokens``. A busy cluster queues; nothing is refused that could ever fit."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest

from tests.cluster.processes import start_serve, stop_group, wait_ready
from tests.router.serve import free_port

TOPICS = ["rivers", "volcanoes", "bread", "chess", "tides", "owls", "glass", "maps", "bees", "comets", "ink",
          "salt", "bridges", "clocks", "moss", "kites"]


@pytest.mark.slow
def test_32_concurrent_chats_without_max_tokens_all_succeed(tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    proc = start_serve(log, "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)

        async def chat(i: int) -> openai.types.chat.ChatCompletion:
            question = f"In two sentences, what is interesting about {TOPICS[i % 16]}? (question {i})"
            return await client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                        messages=[{"role": "user", "content": question}])

        async def all_chats() -> list[openai.types.chat.ChatCompletion]:
            return await asyncio.gather(*(chat(i) for i in range(32)))

        replies = asyncio.run(all_chats())  # any 4xx/5xx raises here
        assert len(replies) == 32
        for reply in replies:
            assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
        for worker in ("prefill-0", "decode-0"):  # each worker's KV size, from a share of free memory
            assert re.search(rf"{worker} ready .*KV cache .* of .* free host memory\): [\d,]+ blocks of 16 = "
                             r"[\d,]+ tokens", log.read_text())
    finally:
        stopped = stop_group(proc, dump_stacks=True)
    assert stopped.rc == 0, log.read_text()
