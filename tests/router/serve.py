"""Serve a router app with uvicorn on a free port in a thread (tests and benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn

from router.app import RouterConfig, create_app
from router.worker_client import WorkerClient
from workers.tokenizer import Tokenizer


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


def serve_router(config: RouterConfig, client: WorkerClient, tokenizer: Tokenizer | None,
                 min_workers: int = 1) -> RouterServer:
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
