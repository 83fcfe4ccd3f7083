"""Issue 22, items 1 and 2 on a whole ``tandem serve --sim`` (real Ray, Redis, router, controller; timing-model
workers): a worker that dies (SIGKILL) or stalls (SIGSTOP) at any point of a request costs the client
nothing. A prefill worker lost while it computes a prompt: the decode worker's call to it ends (the
controller kills a stalled one), the router prefills the prompt on the decode worker instead, and the text
is the same as an undisturbed run's. A decode worker lost mid-stream: its streams go on elsewhere. Either
way the controller starts a replacement, and no KV block stays held. Then item 6 at a small size on the same
cluster: ``tandem soak`` with requests cancelled before their first token and mid-stream and a decode worker
SIGKILLed every few seconds: no request fails, no block is held, every block pool is intact, and the soak's
report and exit status say so."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster.processes import start_serve, stop_group, wait_ready
from tests.cluster.profiles import linear_profile
from tests.router.serve import free_port

pytestmark = [pytest.mark.slow, pytest.mark.scenario]
UNRESPONSIVE_S = 3.0
# ~1,200 prompt tokens take 1.2 s to prefill on the profile below: time to lose the worker mid-prompt.
LONG_PROMPT = " ".join(f"word{i % 97} is" for i in range(300))


@dataclass
class Serve:
    url: str
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    def pid(self, worker: str) -> int:
        found = re.findall(rf"{worker} ready \(pid (\d+)", self.text())
        assert found, self.text()[-3000:]
        return int(found[-1])

    def status(self) -> dict:  # type: ignore[type-arg]
        return httpx.get(f"{self.url}/cluster/status", timeout=10).json()

    def wait_for(self, condition, what: str, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout_s
        while not condition():
            assert time.monotonic() < deadline, f"{what} not seen in {timeout_s:.0f} s:\n{self.text()[-3000:]}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("loss")
    port = free_port()
    profile = linear_profile(prefill_base_s=0.02, prefill_per_token_s=1e-3, decode_base_s=0.03,
                             decode_per_seq_s=0.005, decode_per_ctx_token_s=0.0)
    profile.save(tmp / "profile.json")
    # The liveness probe runs between two engine steps, so a step must stay well under UNRESPONSIVE_S: at 1 ms a
    # prompt token, the default budget of 8,192 tokens let a worker that took over a storm of failed-over streams
    # step for ~5 s, and the controller killed it as stalled (the soak failed 35 requests so, once in two runs).
    pool = {"min_replicas": 0, "max_replicas": 3, "unresponsive_timeout_s": UNRESPONSIVE_S,
            "resources": {"num_cpus": 0.25, "torch_threads": 1}, "engine": {"max_num_batched_tokens": 1536}}
    config = {"name": "losstest", "sim_profile": str(tmp / "profile.json"), "model": {"served_name": "tandem-sim"},
              "prefill": {**pool, "replicas": 1}, "decode": {**pool, "replicas": 2, "min_replicas": 1},
              "ray": {"num_cpus": 4}, "router": {"port": port, "local_prefill_max_tokens": 0}}
    (tmp / "cluster.yaml").write_text(yaml.safe_dump(config))
    log = tmp / "serve.log"
    proc = start_serve(log, "-c", str(tmp / "cluster.yaml"))
    served = Serve(f"http://127.0.0.1:{port}", log)
    try:
        wait_ready(proc, served.url, log)
        yield served
    finally:
        stopped = stop_group(proc, dump_stacks=True)
        assert stopped == (0, False), served.text()[-3000:]


def complete(url: str, prompt: str, max_tokens: int = 24, stream: bool = False) -> dict:  # type: ignore[type-arg]
    """A completion; streamed, its events joined (an error event fails the test)."""
    body = {"model": "tandem-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return {"text": reply.json()["choices"][0]["text"], "tokens": reply.json()["usage"]["completion_tokens"]}
    text, tokens = [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            text.append(event["choices"][0]["text"])
            tokens += 1
    return {"text": "".join(text), "tokens": tokens}


def kv_blocks_held(serve: Serve) -> int:
    return sum(w["kv_blocks_used"] for w in serve.status()["workers"])


@pytest.mark.parametrize("signum", [signal.SIGSTOP, signal.SIGKILL], ids=["stalled", "killed"])
def test_a_prefill_worker_lost_mid_prompt_is_replaced_and_the_prompt_prefilled_locally(serve, signum):
    prompt = f"{signum.name} {LONG_PROMPT}"  # new to every worker: prefilled remotely
    victim = re.findall(r"(prefill-\d+) ready", serve.text())[-1]
    pid = serve.pid(victim)
    result: dict = {}  # type: ignore[type-arg]
    worker = threading.Thread(target=lambda: result.update(complete(serve.url, prompt)))
    t0 = time.monotonic()
    worker.start()
    serve.wait_for(lambda: any(w["id"] == victim and w["num_running"] for w in serve.status()["workers"]),
                   f"{victim} prefilling", timeout_s=10)
    os.kill(pid, signum)
    try:
        worker.join(timeout=UNRESPONSIVE_S + 60)
        assert not worker.is_alive(), "the request hung"
    finally:
        if signum == signal.SIGSTOP:  # killed by the controller by now; never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    elapsed = time.monotonic() - t0
    assert elapsed < UNRESPONSIVE_S + 30, elapsed
    why = "has not answered for" if signum == signal.SIGSTOP else "died"
    serve.wait_for(lambda: f"{victim} {why}" in serve.text(), f"{victim} {why}")
    serve.wait_for(lambda: serve.status()["pools"]["prefill"] == 1
                   and victim not in [w["id"] for w in serve.status()["workers"]], "a replacement prefill worker")
    serve.wait_for(lambda: kv_blocks_held(serve) == 0, "every KV block free")
    # The same text as an undisturbed run (the timing model's tokens depend on the prompt only), here the
    # new prefill worker's: another prompt with the same words, so that no worker holds it cached.
    assert result == complete(serve.url, prompt)
    again = f"{signum.name} again {LONG_PROMPT}"
    assert complete(serve.url, again)["tokens"] == 24


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stalled"])
def test_a_decode_worker_lost_mid_stream_is_replaced_and_its_streams_go_on(serve, signum):
    prompts = [f"question {signum.name} {i}: " + " ".join(f"w{i * 7 + j}" for j in range(40)) for i in range(4)]
    want = [complete(serve.url, p, max_tokens=60, stream=True) for p in prompts]
    results: list[dict] = [{} for _ in prompts]  # type: ignore[type-arg]
    threads = [threading.Thread(target=lambda i=i: results[i].update(complete(serve.url, prompts[i], 60, True)))
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    serve.wait_for(lambda: sum(w["num_running"] for w in serve.status()["workers"] if w["role"] == "decode") >= 4,
                   "four streams decoding", timeout_s=20)
    busiest = max((w for w in serve.status()["workers"] if w["role"] == "decode"), key=lambda w: w["num_running"])
    victim = busiest["id"]
    pid = serve.pid(victim)
    time.sleep(0.3)  # some tokens out
    os.kill(pid, signum)
    try:
        for t in threads:
            t.join(timeout=UNRESPONSIVE_S + 60)
        assert not any(t.is_alive() for t in threads), "a stream hung"
    finally:
        if signum == signal.SIGSTOP:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert [r["text"] for r in results] == [w["text"] for w in want]
    why = "has not answered for" if signum == signal.SIGSTOP else "died"
    serve.wait_for(lambda: f"{victim} {why}" in serve.text(), f"{victim} {why}")
    serve.wait_for(lambda: serve.status()["pools"]["decode"] == 2
                   and victim not in [w["id"] for w in serve.status()["workers"]], "a replacement decode worker")
    serve.wait_for(lambda: kv_blocks_held(serve) == 0, "every KV block free")


def test_soak_with_cancels_and_decode_worker_kills_leaves_nothing_held(serve, tmp_path):
    soak = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "soak", "--url", serve.url, "--num-requests", "120", "--rate", "6",
         "--input-len", "uniform:8:200", "--output-len", "uniform:8:48", "--cancel-share", "0.3",
         "--kill-decode-every", "6", "--tokenizer", "words", "--rss-tolerance", "0.5", "--seed", "5",
         "--out", str(tmp_path / "soak")],
        capture_output=True, text=True, timeout=400, env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    report_path = tmp_path / "soak" / "report.json"
    assert report_path.exists(), soak.stderr[-3000:] + serve.text()[-3000:]
    report = json.loads(report_path.read_text())
    print(json.dumps({k: report[k] for k in ("completed", "cancelled_on_purpose", "failed", "kills", "memory",
                                             "checks")}, indent=1))
    assert report["failed"] == 0, report["failures"]
    assert report["checks"] == {"no_failed_requests": True, "no_blocks_held": True, "block_pools_intact": True,
                                "rss_flat": True}, (report, serve.text()[-3000:])
    assert soak.returncode == 0, soak.stderr[-3000:]
    cancelled = report["cancelled_on_purpose"]
    assert cancelled["before_first_token"] >= 3 and cancelled["mid_stream"] >= 10, cancelled
    assert len(report["kills"]) >= 2 and report["completed"] + sum(cancelled.values()) == 120
    assert len(report["workers_after"]) == 3  # the killed workers were replaced
