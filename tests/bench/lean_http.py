"""A minimal HTTP/1.1 streaming client for latency benchmarks: one kept-alive socket, no framework.

A Python HTTP client library costs milliseconds per request on this 2-core machine (httpx ~2 ms,
aiohttp ~1 ms, measured against this client on a no-op endpoint), which a benchmark of a server's
added latency would otherwise count as the server's. This one does what a C client (curl, wrk)
does: write the request, read chunked SSE until the stream ends, and note when the first event
with text arrived.
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit


class LeanSSEClient:
    def __init__(self, url: str, timeout_s: float = 60.0):
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.sock = socket.create_connection((self.host, parts.port or 80), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def completion_ttft(self, body: dict[str, object]) -> float:
        """POST /v1/completions with ``stream: true``; seconds to the first event with text (or to the
        end of the stream, when no event had text)."""
        payload = json.dumps(body).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n\r\n").encode()
        t0 = time.perf_counter()
        self.sock.sendall(head + payload)
        status_and_headers = self._read_until(b"\r\n\r\n")
        status = int(status_and_headers.split(b" ", 2)[1])
        if status != 200 or b"transfer-encoding: chunked" not in status_and_headers.lower():
            raise RuntimeError(f"expected a 200 chunked stream, got: {status_and_headers[:200]!r}")
        ttft, events = None, b""
        while size := int(self._read_until(b"\r\n"), 16):
            events += self._read_exactly(size + 2)[:-2]
            *complete, events = events.split(b"\n\n")
            for event in complete:
                if ttft is None and event.startswith(b"data: {") and _has_text(event[6:]):
                    ttft = time.perf_counter() - t0
        self._read_exactly(2)  # the CRLF after the last, empty chunk
        return ttft if ttft is not None else time.perf_counter() - t0

    def _read_until(self, marker: bytes) -> bytes:
        while (at := self.buf.find(marker)) < 0:
            self._fill()
        line, self.buf = self.buf[:at], self.buf[at + len(marker):]
        return line

    def _read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data


def _has_text(data: bytes) -> bool:
    choices = json.loads(data).get("choices") or [{}]
    return bool(choices[0].get("text"))
