"""Two Ray nodes on one machine, as an operator builds them: a head (``ray start --head``) and a
second node (``ray start --address``), each with its own custom resource. ``tandem serve
--ray-address`` joins them; the YAML pins prefill to one node and decode to the other, so every
remote prefill's KV crosses between Ray nodes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.processes import stop_group
from tests.router.serve import free_port
from workers.protocol.sampling_params import SamplingParams

pytestmark = pytest.mark.scenario

RAY = str(Path(sys.executable).parent / "ray")
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled"}

CONFIG = """
prefill:
  resources: {{num_cpus: 1, resources: {{node_a: 1}}, torch_threads: 1}}
decode:
  resources: {{num_cpus: 1, resources: {{node_b: 1}}, torch_threads: 1}}
router:
  port: {port}
  local_prefill_max_tokens: 0      # every prompt is prefilled remotely: its KV must cross
  local_prefill_min_overlap: 1.0
"""


def start_node(log: Path, *args: str) -> subprocess.Popen[bytes]:
    """``ray start --block``: the node lives as long as this process; SIGTERM takes the node down."""
    ports = ["--dashboard-agent-listen-port", str(free_port()), "--metrics-export-port", str(free_port())]
    return subprocess.Popen([RAY, "start", "--block", "--object-store-memory", str(200 << 20), *ports, *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=ENV)


def ray_nodes(address: str) -> dict[str, dict[str, float]]:
    """Live node id -> resources, read by a separate driver (the test process stays out of Ray)."""
    code = (f"import json, ray; ray.init(address={address!r}, log_to_driver=False); "
            "print(json.dumps({n['NodeID']: n['Resources'] for n in ray.nodes() if n['Alive']}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("nodes")
    address = f"127.0.0.1:{free_port()}"
    head = start_node(tmp / "head.log", "--head", "--port", address.split(":")[1], "--num-cpus", "2",
                      "--resources", '{"node_a": 1}', "--include-dashboard", "false")
    nodes = [head]
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in (tmp / "head.log").read_text():
            assert head.poll() is None and time.monotonic() < deadline, (tmp / "head.log").read_text()
            time.sleep(0.5)
        nodes.append(start_node(tmp / "node.log", "--address", address, "--num-cpus", "2",
                                "--resources", '{"node_b": 1}'))
        while len(ray_nodes(address)) < 2:
            assert nodes[1].poll() is None and time.monotonic() < deadline, (tmp / "node.log").read_text()
            time.sleep(1)
        yield address
    finally:
        for proc in reversed(nodes):
            stop_group(proc)
        # `ray start` points later `ray.init()` calls on this machine at its cluster; it is gone now.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(address.split(":")[1]):
            current.unlink()


@pytest.mark.slow
def test_prefill_on_one_node_decode_on_the_other_kv_crosses(two_nodes, make_engine, tmp_path):
    port = free_port()
    (tmp_path / "cluster.yaml").write_text(CONFIG.format(port=port))
    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", "-c", str(tmp_path / "cluster.yaml"),
                              "--ray-address", two_nodes], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True, env=ENV)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while "ready: http" not in log.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        engine = make_engine()
        for question in ("What is the capital of France?", "Name three colours of the rainbow, please."):
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                   max_tokens=16, temperature=0)
            want = engine.generate([{"messages": messages}], SamplingParams(max_tokens=16, temperature=0.0))
            assert reply.choices[0].message.content == want[0].text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        sent = re.search(r'^tandem_kv_transfer_bytes_total{[^}]*worker_id="prefill-0"[^}]*} (\S+)$', metrics, re.M)
        assert sent and float(sent[1]) > 0, metrics
        assert re.search(r'^tandem_router_routes_total{prefill="remote"} 2\.0$', metrics, re.M), metrics
    finally:
        stopped = stop_group(serve, dump_stacks=True)
    text = log.read_text()
    assert stopped.rc == 0, text
    placed = dict(re.findall(r"(prefill-0|decode-0) ready \(pid \d+, Ray node (\w+)[,)]", text))
    nodes = ray_nodes(two_nodes)  # the nodes outlive tandem serve: it joined them, it did not start them
    node_of = {w: next(n for n in nodes if n.startswith(prefix)) for w, prefix in placed.items()}
    assert nodes[node_of["prefill-0"]].get("node_a") == 1 and "node_b" not in nodes[node_of["prefill-0"]]
    assert nodes[node_of["decode-0"]].get("node_b") == 1 and "node_a" not in nodes[node_of["decode-0"]]
