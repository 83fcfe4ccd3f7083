"""A bound on request bodies: bigger than ``max_bytes`` is a 413 in OpenAI's error shape, before the body is
read whole (by its Content-Length, or counted as a chunked body arrives)."""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.errors import error_body


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    @property
    def message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (router.max_request_bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            body = json.dumps(error_body(413, self.message, "request_too_large")).encode()
            await send({"type": "http.response.start", "status": 413, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        seen = 0

        async def counted_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:  # a chunked body: the app's error handler answers the 413
                    raise HTTPException(413, self.message)
            return message

        await self.app(scope, counted_receive, send)
