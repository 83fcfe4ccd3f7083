"""API keys: who may call what, checked before any route runs (a plain ASGI wrapper: no per-request task).

    /health, /ready                      open (load balancers and probes)
    /metrics                             open, or an API key with ``metrics_need_key``
    /cluster/*                           an admin key; the API key where no admin key is set
    everything else (/v1/*, /tokenize)   an API key where any is set (an admin key serves too)

Keys come as ``Authorization: Bearer KEY``; a missing or wrong key is a 401 in OpenAI's error shape, an
API key on an admin route a 403. Keys are compared in constant time (``hmac.compare_digest``) and never
logged. With no key configured at all, everything is open, as before.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import error_body

OPEN_PATHS = ("/health", "/ready")


@dataclass(frozen=True)
class AuthConfig:
    api_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: the API is open
    admin_keys: tuple[str, ...] = field(default=(), repr=False)  # empty: the API keys guard /cluster/* too
    metrics_need_key: bool = False

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys or self.admin_keys)


def _matches(token: bytes, keys: Sequence[str]) -> bool:
    # Every key is compared (no early exit), so the time taken does not say which one came close.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key.encode())
    return found


class APIKeyAuth:
    def __init__(self, app: ASGIApp, config: AuthConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.config.enabled:
            await self.app(scope, receive, send)
            return
        refusal = self._check(scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        status, message, code = refusal
        body = json.dumps(error_body(status, message, code)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})

    def _check(self, scope: Scope) -> tuple[int, str, str] | None:
        """None when the call may go on; else (status, message, code)."""
        path: str = scope["path"]
        cfg = self.config
        if path in OPEN_PATHS or (path == "/metrics" and not cfg.metrics_need_key):
            return None
        token = _bearer(scope)
        admin = cfg.admin_keys or cfg.api_keys
        if path.startswith("/cluster/"):
            if token is not None and _matches(token, admin):
                return None
            if token is not None and _matches(token, cfg.api_keys):
                return 403, "this endpoint needs the admin key", "admin_key_required"
        elif not cfg.api_keys or (token is not None and (_matches(token, cfg.api_keys) or _matches(token, admin))):
            return None  # (only an admin key set: the API stays open)
        if token is None:
            return 401, "missing API key: send it as 'Authorization: Bearer KEY'", "missing_api_key"
        return 401, "incorrect API key provided", "invalid_api_key"


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            return token.strip() if scheme.lower() == b"bearer" and token.strip() else None
    return None
