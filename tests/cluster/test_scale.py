"""Live pool changes on a real ``tandem serve`` (real Ray, Redis, HTTP): decode 1 -> 2 -> 1 while a
steady stream of requests runs. None fails, the new worker serves requests, and the removed one
finishes its in-flight requests before it exits. ``tandem apply`` takes a file's pool sizes and
refuses what a running cluster cannot change."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest

from cluster.cli import main as cli_main
from tests.cluster.processes import stop_group
from tests.router.serve import free_port

pytestmark = pytest.mark.scenario

CONFIG = """
prefill:
  replicas: 1
  resources: {torch_threads: 1}
decode:
  replicas: 1
  max_replicas: 3
  resources: {torch_threads: 1}
"""


@dataclass
class Serve:
    url: str
    config: str  # the YAML it runs
    log: Path
    proc: subprocess.Popen[bytes]

    def text(self) -> str:
        return self.log.read_text()

    def cli(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "cluster.cli", *args, "--url", self.url], capture_output=True,
                              text=True, timeout=timeout_s)


@pytest.fixture(scope="module")
def serve(tmp_path_factory) -> Iterator[Serve]:
    tmp = tmp_path_factory.mktemp("scale")
    port = free_port()
    config = CONFIG + f"router: {{port: {port}}}\n"
    (tmp / "cluster.yaml").write_text(config)
    log = tmp / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "-c", str(tmp / "cluster.yaml")],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    served = Serve(f"http://127.0.0.1:{port}", config, log, proc)
    try:
        deadline = time.monotonic() + 300
        while "ready: http" not in served.text():
            assert proc.poll() is None and time.monotonic() < deadline, served.text()
            time.sleep(0.5)
        yield served
    finally:
        stopped = stop_group(proc, dump_stacks=True)
        assert stopped == (0, False), served.text()
        assert "graceful shutdown exceeded" not in served.text(), served.text()  # no stream was left hanging


@dataclass
class SteadyLoad:
    """``clients`` users each sending one streaming chat request after another."""

    url: str
    clients: int = 3
    stop: threading.Event = field(default_factory=threading.Event)
    ok: int = 0
    failures: list[str] = field(default_factory=list)

    def run(self) -> list[threading.Thread]:
        threads = [threading.Thread(target=self._user, args=(i,), daemon=True) for i in range(self.clients)]
        for t in threads:
            t.start()
        return threads

    def _user(self, i: int) -> None:
        client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        n = 0
        while not self.stop.is_set():
            n += 1
            try:
                # 1,000 tokens each (no early stop): 2-4 s at 2-4 ms a token, so a request that just reached a
                # worker is still there when the drain starts (CI's drains found none in flight at 160 tokens, and
                # at 320 once the decode step got faster).
                stream = client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", stream=True, max_tokens=1000, temperature=0,
                    extra_body={"ignore_eos": True},
                    messages=[{"role": "user", "content": f"User {i}, question {n}: name a colour."}])
                reasons = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
                assert reasons in (["stop"], ["length"]), reasons
                self.ok += 1
            except Exception as e:  # noqa: BLE001 - every failure is a finding
                self.failures.append(f"user {i} request {n}: {type(e).__name__}: {e}")


def finished_on(url: str, worker: str) -> float:
    """Requests the worker has finished, from the cluster's merged /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    pattern = rf'^tandem_requests_finished_total{{[^}}]*worker_id="{worker}"[^}}]*}} (\S+)$'
    return sum(float(m) for m in re.findall(pattern, text, re.M))


def status(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(f"{url}/cluster/status", timeout=10).json()


def wait_for_arrival(url: str, worker: str, timeout_s: float) -> None:
    """Return once the worker's running count rises between two polls: a request has just arrived there."""
    def running() -> int:
        return sum(w["num_running"] for w in status(url)["workers"] if w["id"] == worker)
    before = running()
    deadline = time.monotonic() + timeout_s
    while (now := running()) <= before:
        assert time.monotonic() < deadline, f"timed out waiting for a request to reach {worker}"
        before = now
        time.sleep(0.05)


def wait_until(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_decode_1_to_2_to_1_under_steady_load_fails_no_request(serve, capsys):
    load = SteadyLoad(serve.url)
    threads = load.run()
    try:
        wait_until(lambda: load.ok >= 3, 120, "the first requests")
        up = serve.cli("scale", "decode=2", "--wait")
        assert up.returncode == 0, up.stderr + serve.text()
        assert "targets: prefill 1, decode 2" in up.stdout and up.stdout.strip().endswith("draining: -)")
        assert sorted(w["id"] for w in status(serve.url)["workers"]) == ["decode-0", "decode-1", "prefill-0"]
        wait_until(lambda: finished_on(serve.url, "decode-1") >= 3, 120, "decode-1 to serve requests")
        # Scale down right after a request reaches decode-1 (its load report's count rises), so that request has
        # nearly all its tokens left: one merely seen running could end in the ~0.2 s before the drain starts.
        wait_for_arrival(serve.url, "decode-1", 60)
        served_before = load.ok
        # The CLI in this process: a fresh one takes ~3 s to start, long enough for decode-1's request to end.
        assert cli_main(["scale", "decode=1", "--wait", "--url", serve.url]) == 0, serve.text()
        assert "draining: decode-1" in capsys.readouterr().out
        wait_until(lambda: load.ok >= served_before + 3, 120, "requests after the scale-down")
    finally:
        load.stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request never finished"
    assert load.failures == [], load.failures
    log = serve.text()
    drained = re.search(r"decode-1 drained in [\d.]+s: (\d+) in-flight and (\d+) late requests finished", log)
    assert drained and int(drained[1]) >= 1, log
    assert log.index("decode-1 draining") < drained.start() < log.index("decode-1 exited")
    pid = int(re.search(r"decode-1 ready \(pid (\d+),", log)[1])  # type: ignore[index]
    wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 30, "decode-1's process to exit")
    assert sorted(w["id"] for w in status(serve.url)["workers"]) == ["decode-0", "prefill-0"]


def test_apply_takes_pool_sizes_and_refuses_what_needs_a_restart(serve, tmp_path):
    port = serve.url.rsplit(":", 1)[1]
    wider = tmp_path / "wider.yaml"
    wider.write_text(serve.config.replace("max_replicas: 3", "max_replicas: 5"))
    done = serve.cli("apply", "-c", str(wider))
    assert done.returncode == 0 and "targets: prefill 1, decode 1" in done.stdout, done.stderr
    assert httpx.get(f"{serve.url}/cluster/pools").json()["targets"]["decode"] == {
        "replicas": 1, "min_replicas": 1, "max_replicas": 5}
    moved = tmp_path / "moved.yaml"
    moved.write_text(serve.config.replace(f"port: {port}", "port: 1") + "model: {max_model_len: 1024}\n")
    done = serve.cli("apply", "-c", str(moved))
    assert done.returncode == 2
    assert done.stderr.strip() == ("tandem apply: cannot change on a running cluster (restart tandem serve with this "
                                   f"file): model.max_model_len (2048 -> 1024), router.port ({port} -> 1)")
    bad = tmp_path / "bad.yaml"
    bad.write_text("decode: {replicas: 5}\n")
    done = serve.cli("apply", "-c", str(bad))
    assert done.returncode == 2 and done.stderr.strip() == (
        "tandem apply: config error: decode: replicas (5) must be between min_replicas (1) and max_replicas (4)")
    done = serve.cli("scale", "decode=9")
    assert done.returncode == 2 and "decode.replicas: 9 is outside the pool's bounds [1, 5]" in done.stderr
    # Scaled away before it has loaded: it served nothing, so it is cancelled, not drained.
    assert httpx.post(f"{serve.url}/cluster/scale", json={"decode": {"replicas": 2}}).status_code == 202
    wait_until(lambda: "decode-2 starting" in serve.text(), 30, "decode-2 to start")
    done = serve.cli("scale", "decode=1", "--wait")
    assert done.returncode == 0 and "decode-2 cancelled before it was ready" in serve.text(), serve.text()
    assert "decode-2 ready" not in serve.text()
    done = serve.cli("scale", "decoder=2")
    assert done.returncode == 2 and "expected prefill=N or decode=N" in done.stderr


def test_a_router_alone_joins_the_running_cluster_and_serves(serve, tmp_path):
    """``tandem router``: a second router on the same Ray cluster and Redis (as the chart's router pods run)."""
    redis_url = re.search(r"embedded Redis at (\S+)", serve.text())[1]  # type: ignore[index]
    config = tmp_path / "router.yaml"
    config.write_text(serve.config)
    port = free_port()
    log = tmp_path / "router.log"
    proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "router", "-c", str(config), "--port", str(port),
                             "--redis", redis_url, "--ray-address", "auto"], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "RAY_AUTH_MODE": "disabled"})
    try:
        deadline = time.monotonic() + 120
        while "ready: http" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", max_tokens=8, temperature=0,
                                               messages=[{"role": "user", "content": "Name a colour."}])
        assert reply.choices[0].message.content and reply.choices[0].finish_reason in ("stop", "length")
        assert sorted(w["id"] for w in status(url)["workers"]) == sorted(w["id"] for w in status(serve.url)["workers"])
        wait_until(lambda: (status(url)["slo"]["cluster"] or {}).get("routers") == 2, 10, "both routers' reports")
    finally:
        assert stop_group(proc) == (0, False), log.read_text()
