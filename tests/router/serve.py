"""Serve an app (a router) with uvicorn on a free port in a thread (tests and benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import uvicorn
from fastapi import FastAPI

from router.app import create_app
from router.listen import listening_socket
from router.state import RouterConfig
from router.worker_client import WorkerClient
from workers.model.tokenizer import Tokenizer


@dataclass
class AppServer:
    url: str
    app: FastAPI
    server: uvicorn.Server
    thread: threading.Thread

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_app(app: FastAPI, timeout_s: float = 30.0) -> AppServer:
    """Start uvicorn on a free port in a thread; returns once it accepts connections."""
    sock = listening_socket("127.0.0.1", 0)  # as tandem serve listens: bounded send buffers
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError("the server did not start")
        time.sleep(0.05)
    return AppServer(f"http://127.0.0.1:{port}", app, server, thread)


def serve_router(config: RouterConfig, client: WorkerClient, tokenizer: Tokenizer | None,
                 min_workers: int = 1) -> AppServer:
    """A router, returned once ``/ready`` says at least ``min_workers`` workers are live."""
    served = serve_app(create_app(config, client, tokenizer))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        ready = httpx.get(f"{served.url}/ready", timeout=1.0)
        body = ready.json()
        if ready.status_code == 200 and body["decode_workers"] + body["prefill_workers"] >= min_workers:
            return served
        time.sleep(0.1)
    served.stop()
    raise TimeoutError("the router did not become ready")
