"""Limits (issue 22 item 5): a body too big is a 413 however it is sent, a stop string too long a 400, and a
client that stops reading is cut off after the stall timeout, its request cancelled, while another stream
goes on."""

from __future__ import annotations

import json
import socket
import time

import httpx

from tests.router.conftest import MODEL
from tests.router.test_openai_api import held_blocks, wait_idle

LIMIT = 8 << 20  # RouterConfig.max_request_bytes by default


def test_a_body_over_the_limit_is_a_413_with_or_without_a_length(local_cluster) -> None:
    router, _, _ = local_cluster
    big = json.dumps({"model": MODEL, "prompt": "x" * (LIMIT + 10), "max_tokens": 1}).encode()
    response = httpx.post(f"{router.url}/v1/completions", content=big, timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "max_request_bytes" in response.json()["error"]["message"]

    def chunked():  # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1 << 16):
            yield big[i: i + (1 << 16)]

    response = httpx.post(f"{router.url}/v1/completions", content=chunked(), timeout=60,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["type"] == "invalid_request_error"
    small = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(f"{router.url}/v1/completions", json=small, timeout=60).status_code == 200


def test_a_stop_string_too_long_is_a_400(local_cluster) -> None:
    router, _, _ = local_cluster
    for stop in ("s" * 257, ["ok", "s" * 257]):
        response = httpx.post(f"{router.url}/v1/completions", timeout=30,
                              json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stop": stop})
        assert response.status_code == 400 and "stop" in response.json()["error"]["message"]


def test_a_client_that_stops_reading_is_cut_off_and_its_request_cancelled(local_cluster) -> None:
    router, prefill, decode = local_cluster
    config = router.app.state.router.config
    config.client_stall_timeout_s = 1.0
    body = json.dumps({"model": MODEL, "prompt": "Tell me a very long story about the sea.", "max_tokens": 1500,
                       "ignore_eos": True, "logprobs": 20, "stream": True}).encode()  # ~1 KB an event
    host, port = router.url.removeprefix("http://").split(":")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # and it reads nothing
    try:
        stalled.connect((host, int(port)))
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while held_blocks(decode) == 0:  # it runs
            assert time.monotonic() < deadline
            time.sleep(0.05)
        other = httpx.post(f"{router.url}/v1/completions", timeout=60,
                           json={"model": MODEL, "prompt": "Hello", "max_tokens": 8, "stream": False})
        assert other.status_code == 200  # served while the stalled stream waits on its client
        deadline = time.monotonic() + 60  # 1,500 tokens would take far longer here
        metric = "tandem_router_stalled_clients_total 1.0"
        while metric not in httpx.get(f"{router.url}/metrics", timeout=10).text:
            assert time.monotonic() < deadline, "the stalled stream was never cut off"
            time.sleep(0.2)
        wait_idle(prefill, decode)  # cancelled on the workers: every block back
    finally:
        stalled.close()
        config.client_stall_timeout_s = 30.0
