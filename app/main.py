"""The gateway's FastAPI application: its parts, their lifetime, health, and errors."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.ext.asyncio import async_sessionmaker
from starlette.responses import Response

from app.admin.router import router as admin_router
from app.analytics.dashboard import router as dashboard_router
from app.analytics.router import router as analytics_router
from app.auth.service import Authenticator, RateLimiter
from app.auth.sessions import BrowserSessions
from app.config import Settings, get_settings, refuse_development_secrets
from app.db import make_async_engine
from app.feedback.router import router as feedback_router
from app.gateway.assignment import RoutingCache
from app.gateway.router import router as gateway_router
from app.gateway.service import Gateway
from app.gateway.sink import EventSink
from app.gateway.spool import Retention
from app.gateway.upstream import Upstream
from app.http.errors import BodySizeLimit, install_error_handlers
from app.observability import RequestObservability, configure_logging
from app.shutdown import DrainingServer, Shutdown, ShutdownGate

log = logging.getLogger(__name__)

READINESS_TIMEOUT_S = 2.0
STRAGGLERS_S = 5.0
"""How long uvicorn waits past the drain for requests still running before it cancels them."""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; its lifespan opens and closes every connection it uses.

    SettingsError when production services are configured with a development secret.
    """
    settings = settings or get_settings()
    refuse_development_secrets(settings)
    shutdown = Shutdown(settings.shutdown_drain.total_seconds())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_async_engine(settings.database_url, pool_size=10, max_overflow=10)
        session_maker = async_sessionmaker(engine, expire_on_commit=False)
        redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        sink = EventSink.claim(
            settings.kafka_bootstrap_servers,
            settings.spool_dir,
            Retention(settings.spool_retention, settings.spool_retention_bytes),
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
            app.state.authenticator = Authenticator(
                session_maker, failures_per_minute=settings.auth_failures_per_minute
            )
            app.state.browser_sessions = BrowserSessions(redis)
            app.state.rate_limiter = RateLimiter(redis, settings.rate_limit_per_minute)
            app.state.gateway = Gateway(
                upstream=upstream,
                routing=routing,
                sink=sink,
                redis=redis,
                session_maker=session_maker,
            )
            yield
        finally:
            await routing.stop()
            await upstream.aclose()
            # Whatever Kafka did not take by now stays in the spool for the next start.
            await anyio.to_thread.run_sync(sink.close, shutdown.remaining_s())
            await redis.aclose()
            await engine.dispose()

    app = FastAPI(
        title="rtrl gateway",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.shutdown = shutdown
    app.include_router(gateway_router)
    app.include_router(feedback_router)
    app.include_router(admin_router)
    app.include_router(analytics_router)
    app.include_router(dashboard_router)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(ShutdownGate, shutdown=shutdown)
    app.add_middleware(RequestObservability)
    return app


def run_gateway(settings: Settings | None = None) -> None:
    """Serve the gateway with uvicorn on the configured host and port (blocks); SIGTERM
    drains it first (`app.shutdown`)."""
    settings = settings or get_settings()
    configure_logging()
    app = create_app(settings)

    def drain_spool(timeout_s: float) -> bool:
        sink: EventSink | None = getattr(app.state, "sink", None)
        return sink is None or sink.drain(timeout_s)

    config = uvicorn.Config(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(STRAGGLERS_S),
    )
    DrainingServer(config, app.state.shutdown, drain_spool).run()


async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    """Ready when Postgres, Redis, Kafka (or the spool) and one vLLM replica answer, until
    SIGTERM."""
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
    stopping = state.shutdown.started
    ready = all(checks.values()) and not stopping
    body = {
        "status": "shutting_down" if stopping else "ready" if ready else "unavailable",
        "checks": checks,
        "failing": [name for name, ok in checks.items() if not ok],
        "kafka_connected": sink.kafka_connected,
        "spooled_events": sink.depth,
        "spool_retained": sink.retained,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics() -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
