"""A tiny OpenAI-compatible streaming server with known timings, run in a thread for loadgen tests.

The requested model name picks a behaviour: "fake" streams max_tokens chunks (TTFT 30 ms, 5 ms
apart), "bad" answers 400, "boom" 500, "slow" never answers within the client's timeout.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

TTFT_S, GAP_S = 0.03, 0.005


def make_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake", "object": "model"}]}

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def complete(request: Request):  # type: ignore[no-untyped-def]
        body = await request.json()
        model, n = body.get("model"), int(body.get("max_tokens", 16))
        if model == "bad":
            return JSONResponse({"error": {"message": "bad request", "type": "invalid_request_error"}}, 400)
        if model == "boom":
            return JSONResponse({"error": {"message": "internal", "type": "server_error"}}, 500)
        if model == "slow":
            await asyncio.sleep(5)
        chat = "messages" in body

        async def stream():  # type: ignore[no-untyped-def]
            await asyncio.sleep(TTFT_S)
            for i in range(n):
                choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                await asyncio.sleep(GAP_S)
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def running_server() -> Iterator[str]:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        if time.time() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=5)
