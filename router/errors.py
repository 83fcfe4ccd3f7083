"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, registered once.

Bad input is always a 4xx with a message; a busy cluster queues, and past a queue's bound sheds with
429 and ``Retry-After``; 503 (with ``Retry-After``) means no worker of a role is up; only a fault of
ours is a 5xx.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from workers.protocol.errors import OVERLOADED_KINDS, InvalidRequestError

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout_error"}

# What a worker's error kind means for the client.
WORKER_ERROR_STATUS = {"invalid_request": 400, "capacity": 400, "transfer": 503, "unavailable": 503,
                       "internal": 500, **dict.fromkeys(OVERLOADED_KINDS, 429)}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer's body (OpenAI's shape)."""

    error: ErrorDetail


_MEANINGS = {400: "Bad input (the message names the field)", 401: "No valid API key",
             404: "Unknown model or route", 413: "The body is too large", 429: "Overloaded: retry after Retry-After",
             503: "No worker of a role (or no pool controller) is up: retry after Retry-After"}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI entries of the errors a route answers with, so that clients and fuzzers know them."""
    return {status: {"model": ErrorResponse, "description": _MEANINGS[status]} for status in statuses}


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.retry_after_s = retry_after_s


def no_worker_error(role: str) -> APIError:
    """No worker of ``role`` is up: the one 503 a client may retry after a moment."""
    return APIError(503, f"no {role} worker is available; try again shortly", "no_worker", retry_after_s=1)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error" if status >= 500 else
                                                             "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(error: APIError) -> JSONResponse:
    headers = {"Retry-After": str(error.retry_after_s)} if error.retry_after_s is not None else None
    return JSONResponse(error_body(error.status, error.message, error.code, error.param), error.status,
                        headers=headers)


def _describe(errors: list[Any]) -> tuple[str, str | None]:
    """One line naming the field; a union field lists why each of its accepted forms failed."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":  # OpenAI's words for a field it does not know
        return f"Unrecognized request argument supplied: {param}", param
    if not loc:
        return str(first.get("msg", "invalid request")).removeprefix("Value error, "), None
    same = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == loc[:1]]
    if len(same) > 1:
        reasons = "; ".join(f"as {'.'.join(str(p) for p in e['loc'][2:]) or 'value'}: {e['msg']}" for e in same)
        return f"{loc[0]}: not a valid value ({reasons})", loc[0]
    return f"{param}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return JSONResponse(error_body(400, str(exc), "invalid_request"), 400)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe(list(exc.errors()))
        return JSONResponse(error_body(400, message, "invalid_request", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}"), 500)
