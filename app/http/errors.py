"""Errors in the OpenAI shape, `{"error": {message, type, param, code}}`, on every route but
Anthropic's Messages API (`/v1/messages`), whose errors come in Anthropic's shape,
`{"type": "error", "error": {type, message}}`."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Literal, Self

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import OperationalError
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.observability import request_id_var

log = logging.getLogger(__name__)

ANTHROPIC_PATH = "/v1/messages"
"""Errors on this path and under it are answered in Anthropic's shape."""

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}

ErrorType = Literal[
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "conflict_error",
    "rate_limit_error",
    "request_too_large",
    "service_unavailable",
    "api_error",
]


class ApiError(Exception):
    """An error answered in the OpenAI error shape: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: ErrorType = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def service_unavailable(
        cls,
        message: str,
        *,
        code: str,
        retry_after_s: int,
        type: ErrorType = "service_unavailable",
    ) -> Self:
        """A 503 the client may retry after `retry_after_s` seconds (`Retry-After`)."""
        return cls(503, message, type=type, code=code, headers=_retry_after(retry_after_s))

    @classmethod
    def too_many_requests(
        cls,
        message: str,
        *,
        code: str,
        retry_after_s: int,
        headers: Mapping[str, str] | None = None,
    ) -> Self:
        """A 429 the client may retry after `retry_after_s` seconds (`Retry-After`, then
        `headers`)."""
        return cls(
            429,
            message,
            type="rate_limit_error",
            code=code,
            headers=_retry_after(retry_after_s) | dict(headers or {}),
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, code=self.code, param=self.param)

    def response(self, path: str = "") -> Response:
        """The error as the client gets it (on `path`: in Anthropic's shape under
        `ANTHROPIC_PATH`)."""
        if speaks_anthropic(path):
            body = anthropic_error_body(self.message, status=self.status_code, type=self.type)
            return error_response(self.status_code, body, self.headers)
        return error_response(self.status_code, self.body(), self.headers)


def _retry_after(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(seconds)}


def error_body(
    message: str, *, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_ANTHROPIC_TYPES = {
    "conflict_error": "invalid_request_error",
    "service_unavailable": "overloaded_error",
}
"""OpenAI-shape error types Anthropic's API names otherwise; the rest it names alike."""


def speaks_anthropic(path: str) -> bool:
    """Whether a request on `path` is answered in Anthropic's terms (`ANTHROPIC_PATH`)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(message: str, *, status: int, type: str) -> dict[str, Any]:
    """Anthropic's error object; a type of the OpenAI shape is named as Anthropic names it."""
    if status >= 500 and type not in _ANTHROPIC_TYPES:
        type = "api_error"
    return {
        "type": "error",
        "error": {"type": _ANTHROPIC_TYPES.get(type, type), "message": message},
    }


def _shaped_for(
    request: Request, status_code: int, body: dict[str, Any], headers: Mapping[str, str] | None
) -> Response:
    """An OpenAI-shape error body, answered in Anthropic's shape where the path asks for it."""
    if speaks_anthropic(request.url.path):
        error = body["error"]
        body = anthropic_error_body(error["message"], status=status_code, type=error["type"])
    return error_response(status_code, body, headers)


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of the app in the OpenAI shape (Anthropic's on its path)."""
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(Exception, _unexpected_error)


class BodySizeLimit:
    """Answers 413 to bodies over `max_bytes`, by Content-Length or as they stream in."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await _send_error(send, self._too_large(), scope.get("path", ""))
                return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise self._too_large()
            return message

        await self.app(scope, limited_receive, send)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"The request body exceeds {self.max_bytes} bytes.",
            type="request_too_large",
            code="request_too_large",
        )


def error_response(
    status_code: int, body: dict[str, Any], headers: Mapping[str, str] | None = None
) -> Response:
    """An error in the OpenAI shape."""
    return Response(orjson.dumps(body), status_code, headers=headers, media_type="application/json")


async def _send_error(send: Send, error: ApiError, path: str) -> None:
    await error.response(path)({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response(request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = _ERROR_TYPES.get(exc.status_code, "api_error")
    return _shaped_for(
        request, exc.status_code, error_body(str(exc.detail), type=error_type), exc.headers
    )


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(part) for part in error["loc"]) or None
    message = f"Invalid {param or 'request'}: {error['msg']}"
    body = error_body(message, type="invalid_request_error", param=param)
    return _shaped_for(request, 400, body, None)


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    # Admin and analytics read Postgres on every request; the completion path does not.
    log.warning("database unavailable: %s", str(exc).splitlines()[0])
    return ApiError.service_unavailable(
        "The database is unavailable; retry shortly.",
        type="api_error",
        code="database_unavailable",
        retry_after_s=5,
    ).response(request.url.path)


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    message = f"Internal error; quote request id {request_id_var.get()} when reporting it."
    return _shaped_for(request, 500, error_body(message, type="api_error"), None)
