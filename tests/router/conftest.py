"""A small cluster in this process: prefill 'p0' and decode 'd0' services publishing to a real
Redis, and a router served by uvicorn on a real port (the openai client talks real HTTP)."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from router.app import RouterConfig, create_app
from router.policy import PolicyConfig
from router.worker_client import LocalWorkerClient
from workers.decode_service import DecodeService
from workers.prefill_clients import LocalPrefillClient
from workers.prefill_service import PrefillService
from workers.publisher import PublishConfig
from workers.tcp_transport import TcpTransport

MODEL = "tandem-test"


@dataclass
class RouterServer:
    url: str
    app: object
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_router(config: RouterConfig, client, tokenizer, min_workers: int = 1) -> RouterServer:  # type: ignore[no-untyped-def]
    app = create_app(config, client, tokenizer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ready = httpx.get(f"{url}/ready", timeout=1.0)
            body = ready.json()
            if ready.status_code == 200 and body["decode_workers"] + body["prefill_workers"] >= min_workers:
                return RouterServer(url, app, server, thread)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.should_exit = True
    raise TimeoutError("the router did not become ready")


@pytest.fixture(scope="module")
def local_cluster(make_engine, redis_url) -> Iterator[tuple[RouterServer, PrefillService, DecodeService]]:
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    publish = PublishConfig(redis_url, cluster)
    prefill = PrefillService(make_engine(max_model_len=2048), TcpTransport(), "p0", publish=publish)
    decode = DecodeService(make_engine(max_model_len=2048), TcpTransport(), "d0",
                           LocalPrefillClient({"p0": prefill}), transfer_timeout_s=10.0, publish=publish)
    # Local prefill only for very short prompts, so most requests cross from p0 to d0.
    config = RouterConfig(redis_url, cluster, served_model_name=MODEL,
                          policy=PolicyConfig(local_prefill_max_tokens=8, local_prefill_min_overlap=1.0))
    router = serve_router(config, LocalWorkerClient({"d0": decode}, {"p0": prefill}), decode.loop.engine.tokenizer,
                          min_workers=2)
    yield router, prefill, decode
    router.stop()
    decode.close()
    prefill.close()
