"""``tandem serve`` as a user runs it: a real process, real Ray, Redis and HTTP; Ctrl-C/SIGTERM
stops everything it started."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from kernels import cpu_kernel
from tests.cluster.processes import start_serve, stop_group, wait_ready
from tests.router.serve import free_port
from workers.protocol.sampling_params import SamplingParams


@pytest.mark.slow
def test_serve_answers_then_stops_everything_it_started(make_engine, tmp_path):
    port = free_port()
    proc = start_serve(tmp_path / "serve.log", "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, tmp_path / "serve.log")
        assert httpx.get(f"{url}/health").status_code == 200
        assert f"ready: {url}" in open(tmp_path / "serve.log").read()
        # The worker names the instruction set its CPU kernels run (TANDEM_CPU_ISA pins it; here the CPU's best).
        isa, served = cpu_kernel.instruction_set_in_use(), open(tmp_path / "serve.log").read()
        assert f"CPU kernels {isa}); " in served if isa else "CPU kernels" not in served
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                               temperature=0)
        want = make_engine().generate([{"messages": messages}], SamplingParams(max_tokens=16, temperature=0.0))
        assert reply.choices[0].message.content == want[0].text
        # The same chat again: whichever worker prefills it now finds its prompt's full blocks cached.
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=1)
        num_prompt_blocks = (reply.usage.prompt_tokens - 1) // 16  # the last token is always computed
        deadline = time.monotonic() + 10.0
        while True:
            status = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url, "--json"],
                                    capture_output=True, text=True, timeout=60, check=True)
            workers = {w["id"]: w for w in json.loads(status.stdout)["workers"]}
            hits = sum(w["prefix_cache_hit_tokens"] for w in workers.values())
            if hits >= num_prompt_blocks * 16 or time.monotonic() > deadline:  # load reports come every 0.1 s
                break
            time.sleep(0.2)
        assert sorted(workers) == ["decode-0"]  # the default on a small CPU host: one worker, local prefill
        assert num_prompt_blocks > 0 and hits >= num_prompt_blocks * 16
        for w in workers.values():
            assert w["healthy"] and w["num_running"] == 0 and w["num_waiting"] == 0
            assert 0 <= w["kv_blocks_used"] < w["kv_blocks_total"]
        table = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url], capture_output=True,
                               text=True, timeout=60, check=True).stdout
        assert "decode-0" in table
        chat_without_max_tokens_32_at_once(url, tmp_path / "serve.log")
    finally:
        stopped = stop_group(proc, dump_stacks=True)
    assert stopped.rc == 0, open(tmp_path / "serve.log").read()
    assert "graceful shutdown exceeded" not in open(tmp_path / "serve.log").read()  # no stream left hanging
    assert not stopped.orphans, "processes of tandem serve outlived it"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=1)


TOPICS = ["rivers", "volcanoes", "bread", "chess", "tides", "owls", "glass", "maps", "bees", "comets", "ink",
          "salt", "bridges", "clocks", "moss", "kites"]


def chat_without_max_tokens_32_at_once(url: str, log: Path) -> None:
    """What a chat user brings: many conversations at once, none with ``max_tokens``. A busy cluster
    queues; nothing that could ever fit is refused (before issue 19, the third of these got a 503)."""
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
    # the worker's KV size, from a share of free memory
    assert re.search(r"decode-0 ready .*KV cache .* of .* free host memory\): [\d,]+ blocks of 16 = [\d,]+ tokens",
                     log.read_text())


@pytest.mark.slow
def test_sigterm_cuts_a_stream_still_running_after_the_shutdown_grace(tmp_path):
    port = free_port()
    (tmp_path / "cluster.yaml").write_text(f"router: {{port: {port}, shutdown_grace_s: 1}}\n")
    proc = start_serve(tmp_path / "serve.log", "-c", str(tmp_path / "cluster.yaml"))
    url = f"http://127.0.0.1:{port}"
    outcome: list[str] = []

    def long_stream() -> None:  # far longer than the grace: 2,000 tokens, no early stop
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Count:", max_tokens=2000,
                                               stream=True, temperature=0, extra_body={"ignore_eos": True})
            for _ in stream:
                if not outcome:
                    outcome.append("streaming")
            outcome.append("finished")
        except Exception as e:  # noqa: BLE001 - the cut, as the client sees it
            outcome.append(type(e).__name__)

    try:
        wait_ready(proc, url, tmp_path / "serve.log")
        client = threading.Thread(target=long_stream, daemon=True)
        client.start()
        deadline = time.monotonic() + 120
        while not outcome:
            assert time.monotonic() < deadline and client.is_alive(), "no first chunk"
            time.sleep(0.1)
        t0 = time.monotonic()
    finally:
        stopped = stop_group(proc, dump_stacks=True)
    text = (tmp_path / "serve.log").read_text()
    assert stopped == (0, False), text
    assert time.monotonic() - t0 < 60, text  # the grace, then the usual stop; not the stream's length
    assert "graceful shutdown exceeded" in text, text
    client.join(timeout=30)
    assert not client.is_alive() and outcome[0] == "streaming" and outcome[-1] != "finished", outcome


def test_serve_refuses_a_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  replicaz: 2\n")
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "-c", str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "tandem serve: config error: decode.replicaz: unknown key"
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "--dry-run"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TANDEM_CPU_ISA": "avx3"})
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("tandem serve: config error: TANDEM_CPU_ISA=avx3: unknown "
                                                    "instruction set; known: best, avx2, avx_vnni, avx512_vnni, amx")


def test_a_stuck_router_shutdown_still_stops_the_workers_and_exits():
    from types import SimpleNamespace

    from cluster.router_runner import bounded_shutdown

    events: list[str] = []
    server = SimpleNamespace(should_exit=True, servers=[])
    launcher = SimpleNamespace(stop=lambda: events.append("workers stopped"))
    bounded_shutdown(server, threading.Event(), 0.2, launcher, events.append, lambda rc: events.append(f"exit {rc}"))
    assert events[0].startswith("shutdown still not done") and events[-2:] == ["workers stopped", "exit 0"]
    done = threading.Event()
    done.set()  # the normal path: nothing is stopped twice
    bounded_shutdown(server, done, 0.2, launcher, events.append, lambda rc: events.append("exit again"))
    assert events.count("workers stopped") == 1 and "exit again" not in events
