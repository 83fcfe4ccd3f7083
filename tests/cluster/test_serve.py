"""``tandem serve`` as a user runs it: a real process, real Ray, Redis and HTTP; Ctrl-C/SIGTERM
stops everything it started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.cluster.processes import stop_group
from tests.router.serve import free_port
from workers.sampling_params import SamplingParams


@pytest.mark.slow
def test_serve_answers_then_stops_everything_it_started(make_engine, tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)], stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "not ready in 300 s"
            time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 200
        assert f"ready: {url}" in open(tmp_path / "serve.log").read()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=16,
                                               temperature=0)
        want = make_engine().generate([{"messages": messages}], SamplingParams(max_tokens=16, temperature=0.0))
        assert reply.choices[0].message.content == want[0].text
        status = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url, "--json"],
                                capture_output=True, text=True, timeout=60, check=True)
        workers = {w["id"]: w for w in json.loads(status.stdout)["workers"]}
        assert sorted(workers) == ["decode-0", "prefill-0"]
        for w in workers.values():
            assert w["healthy"] and w["num_running"] == 0 and w["num_waiting"] == 0
            assert 0 <= w["kv_blocks_used"] < w["kv_blocks_total"] and w["prefix_cache_hit_tokens"] >= 0
        table = subprocess.run([sys.executable, "-m", "cluster.cli", "status", "--url", url], capture_output=True,
                               text=True, timeout=60, check=True).stdout
        assert "decode-0" in table and "prefill-0" in table
    finally:
        stopped = stop_group(proc, dump_stacks=True)
    assert stopped.rc == 0, open(tmp_path / "serve.log").read()
    assert "graceful shutdown exceeded" not in open(tmp_path / "serve.log").read()  # no stream left hanging
    assert not stopped.orphans, "processes of tandem serve outlived it"
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=1)


def test_serve_refuses_a_bad_config_in_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode:\n  replicaz: 2\n")
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "serve", "-c", str(bad)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "tandem serve: config error: decode.replicaz: unknown key"
