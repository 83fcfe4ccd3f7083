"""Serve an app (a router) with uvicorn on a free port in a thread (tests and benchmarks)."""

from __future__ import annotations

import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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


# Ray's workers listen on 10002-19999 (its default worker port range).
_ABOVE_RAY_WORKER_PORTS = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def free_port() -> int:
    """A port free now, for a server that binds it later (``tandem serve`` binds its router's after Ray and the
    model are up, seconds on). Drawn below the kernel's ephemeral range where it can: every process that binds
    port 0 meanwhile (Ray's, the embedded Redis) draws from that range, and once took the port first."""
    ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0]) if _EPHEMERAL_RANGE.exists() else 0
    if ephemeral_low - _ABOVE_RAY_WORKER_PORTS >= 1000:
        for _ in range(100):
            port = random.randrange(_ABOVE_RAY_WORKER_PORTS, ephemeral_low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:  # no such range here: whatever the kernel gives
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
