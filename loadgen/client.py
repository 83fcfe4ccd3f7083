"""Async streaming OpenAI client that records when every chunk arrives.

Never raises for a failed request: connection refused, HTTP errors, timeouts and broken streams
become ``RequestRecord.error`` with a kind prefix, so a run always completes and counts them.

On aiohttp (its HTTP parser is compiled): the client shares the machine with the server it measures
whenever both run on one host, and every microsecond it spends a token is taken from the server's
cores. `tandem loadgen --concurrency 8` against `tandem serve` on 2 cores, runs alternated: on httpx
(pure-Python HTTP/1.1) it took 105-117 us of CPU a token, on aiohttp 52-67; the server's decode steps
(tandem_step_seconds) averaged 6.88 ms (median of 5 runs) beside it against 6.38 (7 runs), ITL p50 6.89
against 6.59 ms.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from loadgen.metrics import RequestRecord


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # e.g. http://127.0.0.1:8000 (with or without /v1)
    model: str
    api: str = "chat"  # "chat" or "completions"
    timeout_s: float = 300.0
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str | None = None  # sent as "Authorization: Bearer KEY"
    top_p: float | None = None  # sent where set (a chat client's usual 0.9-0.95), else the server's default

    @property
    def endpoint(self) -> str:
        base = self.base_url.rstrip("/")
        if not base.endswith("/v1"):
            base += "/v1"
        return base + ("/chat/completions" if self.api == "chat" else "/completions")


def request_body(cfg: ClientConfig, messages: list[dict[str, str]], max_tokens: int | None) -> dict[str, Any]:
    """``max_tokens`` None: an open-ended chat (no max_tokens, no ignore_eos: it ends at EOS)."""
    body: dict[str, Any] = {"model": cfg.model, "stream": True, "stream_options": {"include_usage": True},
                            "temperature": cfg.temperature}
    if cfg.top_p is not None:
        body["top_p"] = cfg.top_p
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
        if cfg.ignore_eos:
            body["ignore_eos"] = True  # vLLM, SGLang, Tandem honour it; others ignore unknown fields
    if cfg.api == "chat":
        body["messages"] = messages
    else:
        body["prompt"] = "\n\n".join(m["content"] for m in messages)
    return body


def open_session(cfg: ClientConfig) -> aiohttp.ClientSession:
    """The run's connection pool: no cap on connections (a request never waits for one), ``timeout_s`` for
    connecting and for each read (no answer, or a stream silent that long, is a timeout), none on the whole."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.timeout_s, sock_read=cfg.timeout_s)
    # read_bufsize: a stream's line (one chunk's JSON) may run long with log probabilities; lines past it fail.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout, read_bufsize=2**20)


async def send_streaming(session: aiohttp.ClientSession, cfg: ClientConfig, record: RequestRecord,
                         messages: list[dict[str, str]], max_tokens: int | None, clock_zero: float) -> str:
    """Send one request, filling ``record``; returns the generated text (for multi-turn history)."""
    record.send_s = time.perf_counter() - clock_zero
    pieces: list[str] = []
    try:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
        async with session.post(cfg.endpoint, json=request_body(cfg, messages, max_tokens),
                                headers=headers) as resp:
            record.status = resp.status
            if resp.status != 200:
                detail = (await resp.read()).decode("utf-8", "replace")[:300]
                record.error = f"http {resp.status}: {detail}"
                return ""
            async for line in resp.content:  # a line at a time; leaving early closes the connection
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                _handle_chunk(json.loads(data), record, pieces, time.perf_counter() - clock_zero)
        if not record.token_times_s and record.error is None:
            record.error = "empty: the stream ended without a token"
        if record.output_tokens == 0:
            record.output_tokens = len(record.token_times_s)
    except aiohttp.ClientConnectorError as e:
        record.error = f"connect: {e}"
    except TimeoutError:  # aiohttp's read and connect timeouts are TimeoutErrors
        record.error = f"timeout: no answer within {cfg.timeout_s}s"
    except (aiohttp.ClientError, ValueError) as e:  # ValueError: a line that is not JSON, or past read_bufsize
        record.error = f"stream: {type(e).__name__}: {e}"
    finally:
        record.end_s = time.perf_counter() - clock_zero
    return "".join(pieces)


def _handle_chunk(obj: dict[str, Any], record: RequestRecord, pieces: list[str], now_s: float) -> None:
    if "error" in obj:
        record.error = f"stream: {obj['error']}"
        return
    usage = obj.get("usage")
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.input_tokens = int(usage.get("prompt_tokens") or record.input_tokens)
    for choice in obj.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
        if piece:
            pieces.append(piece)
            record.token_times_s.append(now_s)
