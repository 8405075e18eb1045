"""The gateway's FastAPI application: its parts, their lifetime, health, and errors."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.exceptions import HTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.admin.router import router as admin_router
from app.analytics.dashboard import router as dashboard_router
from app.analytics.router import router as analytics_router
from app.auth.service import Authenticator, RateLimiter
from app.config import Settings, get_settings
from app.db import make_async_engine
from app.feedback.router import router as feedback_router
from app.gateway.assignment import RoutingCache
from app.gateway.router import router as gateway_router
from app.gateway.schemas import ApiError, error_body
from app.gateway.service import Gateway
from app.gateway.spool import EventSink
from app.gateway.upstream import Upstream
from app.observability import RequestObservability, configure_logging, request_id_var

log = logging.getLogger(__name__)

READINESS_TIMEOUT_S = 2.0
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


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; its lifespan opens and closes every connection it uses."""
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_async_engine(settings.database_url, pool_size=10, max_overflow=10)
        session_maker = async_sessionmaker(engine, expire_on_commit=False)
        redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        sink = EventSink(
            settings.kafka_bootstrap_servers,
            settings.spool_dir,
            memory_events=settings.spool_memory_events,
        )
        upstream = Upstream(settings.vllm_urls, timeout_s=settings.upstream_timeout_s)
        routing = RoutingCache(session_maker, redis)
        try:
            sink.start()
            await routing.start()
            app.state.settings = settings
            app.state.session_maker = session_maker
            app.state.redis = redis
            app.state.sink = sink
            app.state.authenticator = Authenticator(session_maker)
            app.state.rate_limiter = RateLimiter(redis, settings.rate_limit_per_minute)
            app.state.gateway = Gateway(upstream=upstream, routing=routing, sink=sink, redis=redis)
            yield
        finally:
            await routing.stop()
            await upstream.aclose()
            # Whatever Kafka did not take by now stays in the spool for the next start.
            await anyio.to_thread.run_sync(sink.close)
            await redis.aclose()
            await engine.dispose()

    app = FastAPI(
        title="rtrl gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.include_router(gateway_router)
    app.include_router(feedback_router)
    app.include_router(admin_router)
    app.include_router(analytics_router)
    app.include_router(dashboard_router)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(OperationalError, _database_unavailable)
    app.add_exception_handler(Exception, _unexpected_error)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(RequestObservability)
    return app


def run_gateway(settings: Settings | None = None) -> None:
    """Serve the gateway with uvicorn on the configured host and port (blocks)."""
    settings = settings or get_settings()
    configure_logging()
    uvicorn.run(
        create_app(settings),
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=30,
    )


async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    """Ready when Postgres, Redis, Kafka (or the spool) and one vLLM replica answer."""
    state = request.app.state
    sink: EventSink = state.sink

    async def database() -> bool:
        async with state.session_maker() as session:
            await session.execute(text("SELECT 1"))
        return True

    async def redis() -> bool:
        return bool(await state.redis.ping())

    async def vllm() -> bool:
        return any((await state.gateway.upstream.replica_health()).values())

    async def within_timeout(check: Any) -> bool:
        try:
            return bool(await asyncio.wait_for(check(), READINESS_TIMEOUT_S))
        except Exception:
            return False

    results = await asyncio.gather(*(within_timeout(c) for c in (database, redis, vllm)))
    checks = dict(zip(("database", "redis", "vllm"), results, strict=True))
    # Events are safe while either Kafka takes them or the spool can hold them.
    checks["events"] = sink.kafka_connected or os.access(sink.disk.directory, os.W_OK)
    ready = all(checks.values())
    body = {
        "status": "ready" if ready else "unavailable",
        "checks": checks,
        "failing": [name for name, ok in checks.items() if not ok],
        "kafka_connected": sink.kafka_connected,
        "spooled_events": sink.depth,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics() -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


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
                await _send_error(send, self._too_large())
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


async def _send_error(send: Send, error: ApiError) -> None:
    response = error_response(error.status_code, error.body(), error.headers)
    await response({"type": "http"}, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status_code, exc.body(), exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error_type = _ERROR_TYPES.get(exc.status_code, "api_error")
    return error_response(
        exc.status_code, error_body(str(exc.detail), type=error_type), exc.headers
    )


async def _validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
    param = ".".join(str(part) for part in error["loc"]) or None
    message = f"Invalid {param or 'request'}: {error['msg']}"
    return error_response(400, error_body(message, type="invalid_request_error", param=param))


async def _database_unavailable(request: Request, exc: Exception) -> Response:
    # Admin and analytics read Postgres on every request; the completion path does not.
    log.warning("database unavailable: %s", str(exc).splitlines()[0])
    return error_response(
        503,
        error_body(
            "The database is unavailable; retry shortly.",
            type="api_error",
            code="database_unavailable",
        ),
        {"Retry-After": "5"},
    )


async def _unexpected_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error", exc_info=exc)
    message = f"Internal error; quote request id {request_id_var.get()} when reporting it."
    return error_response(500, error_body(message, type="api_error"))
