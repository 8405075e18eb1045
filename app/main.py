"""The gateway's FastAPI application: its parts, their lifetime, health, and errors."""

from __future__ import annotations

import asyncio
import gc
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from multiprocessing.process import BaseProcess as SpawnProcess
from types import FrameType
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
from app.analytics.exports import ExportStreams
from app.analytics.router import router as analytics_router
from app.auth.service import Authenticator, RateLimiter
from app.auth.sessions import BrowserSessions
from app.client_events.router import router as adapters_router
from app.config import Settings, get_settings, refuse_development_secrets
from app.db import make_async_engine
from app.feedback.router import router as feedback_router
from app.gateway.chat import router as chat_router
from app.gateway.in_flight import InFlight
from app.gateway.messages import router as messages_router
from app.gateway.responses import router as responses_router
from app.gateway.router import router as gateway_router
from app.gateway.routing_cache import RoutingCache
from app.gateway.service import Gateway
from app.gateway.sink import EventSink
from app.gateway.spool import Retention
from app.gateway.upstream import Upstream
from app.http.errors import BodySizeLimit, install_error_handlers
from app.http.state import AppState, app_state, install_app_state
from app.kafka.clients import kafka_security
from app.observability import RequestObservability, configure_logging
from app.shutdown import DrainingServer, Shutdown, ShutdownGate

log = logging.getLogger(__name__)

READINESS_TIMEOUT_S = 2.0
STRAGGLERS_S = 5.0
"""How long uvicorn waits past the drain for requests still running before it cancels them."""
SWITCH_INTERVAL_S = 0.001
WORKER_STARTUP_S = 10.0
"""A worker process that exits sooner than this after its start failed to start."""


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app; its lifespan opens and closes every connection it uses.

    SettingsError when production services are configured with a development secret.
    """
    settings = settings or get_settings()
    refuse_development_secrets(settings)
    shutdown = Shutdown(settings.shutdown_drain.total_seconds())
    app = FastAPI(
        title="rtrl gateway",
        lifespan=_lifespan(settings, shutdown),
        docs_url=None,
        redoc_url=None,
    )
    # Read by the server before the lifespan starts: it begins the drain on SIGTERM.
    app.state.shutdown = shutdown
    _include_routes(app)
    install_error_handlers(app)
    _add_middleware(app, settings, shutdown)
    return app


def _lifespan(
    settings: Settings, shutdown: Shutdown
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Open the app's connections and parts (`AppState`) as it starts; close them as it
    stops, handing the events Kafka has not taken to the spool."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine = make_async_engine(settings.database_url, pool_size=10, max_overflow=10)
        session_maker = async_sessionmaker(engine, expire_on_commit=False)
        exports = ExportStreams(settings.database_url, settings.export_streams)
        redis = Redis.from_url(settings.redis_url, socket_timeout=5, socket_connect_timeout=2)
        sink = EventSink.claim(
            settings.kafka_bootstrap_servers,
            settings.spool_dir,
            Retention(settings.spool_retention, settings.spool_retention_bytes),
            memory_events=settings.spool_memory_events,
            min_free_bytes=settings.spool_min_free_bytes,
            producer_options={"max_request_size": settings.kafka_max_message_bytes},
            security=kafka_security(settings),
        )
        upstream = Upstream(
            settings.vllm_urls,
            timeout_s=settings.upstream_timeout_s,
            max_connections=settings.upstream_max_connections,
            pool_wait_s=settings.upstream_pool_wait_s,
            max_body_bytes=settings.upstream_max_body_bytes,
            api_key=settings.vllm_api_key.get_secret_value(),
        )
        routing = RoutingCache(session_maker, redis)
        try:
            sink.start()
            await routing.start()
            state = AppState(
                settings=settings,
                session_maker=session_maker,
                redis=redis,
                sink=sink,
                exports=exports,
                authenticator=Authenticator(
                    session_maker, failures_per_minute=settings.auth_failures_per_minute
                ),
                browser_sessions=BrowserSessions(redis),
                rate_limiter=RateLimiter(redis, settings.rate_limit_per_minute),
                in_flight=InFlight(
                    settings.max_in_flight_per_key, expire_s=2 * settings.upstream_timeout_s
                ),
                gateway=Gateway(
                    upstream=upstream,
                    routing=routing,
                    sink=sink,
                    redis=redis,
                    session_maker=session_maker,
                ),
            )
            install_app_state(app, state)
            yield
        finally:
            await routing.stop()
            await upstream.aclose()
            # Whatever Kafka did not take by now stays in the spool for the next start.
            await anyio.to_thread.run_sync(sink.close, shutdown.remaining_s())
            await redis.aclose()
            await exports.aclose()
            await engine.dispose()

    return lifespan


def _include_routes(app: FastAPI) -> None:
    """Every router of the API, then the probes and metrics, which the schema leaves out."""
    app.include_router(gateway_router)
    app.include_router(chat_router)
    app.include_router(messages_router)
    app.include_router(responses_router)
    app.include_router(feedback_router)
    app.include_router(adapters_router)
    app.include_router(admin_router)
    app.include_router(analytics_router)
    app.include_router(dashboard_router)
    app.add_api_route("/healthz", healthz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/readyz", readyz, methods=["GET"], include_in_schema=False)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)


def _add_middleware(app: FastAPI, settings: Settings, shutdown: Shutdown) -> None:
    """The middleware, innermost first: the body limit, the shutdown gate, then the request's
    observability around everything."""
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes)
    app.add_middleware(ShutdownGate, shutdown=shutdown)
    app.add_middleware(RequestObservability)


def run_gateway(settings: Settings | None = None, *, workers: int = 1) -> None:
    """Serve the gateway with uvicorn on the configured host and port (blocks); SIGTERM
    drains it first (`app.shutdown`). With `workers` > 1, that many processes share the
    listening socket, each with its own spool directory (`serve_workers`)."""
    settings = settings or get_settings()
    configure_logging()
    if workers > 1:
        raise SystemExit(serve_workers(settings, workers))
    _draining_server(settings).run()


def _draining_server(settings: Settings) -> DrainingServer:
    # The event-sink threads (kafka-python is Python) hold the GIL for up to the switch
    # interval whenever the event loop wants it back: 5 ms by default, the whole p99 budget.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(settings)
    # What the imports built lives as long as the process: out of the collector's way, so
    # that a full collection does not walk it in the middle of a request.
    gc.collect()
    gc.freeze()

    def drain_spool(timeout_s: float) -> bool:
        try:
            sink = app_state(app).sink
        except LookupError:  # not started: nothing spooled
            return True
        return sink.drain(timeout_s)

    config = uvicorn.Config(
        app,
        host=settings.gateway_host,
        port=settings.gateway_port,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=int(STRAGGLERS_S),
        # X-Forwarded-For only from the configured load balancers (uvicorn's default trusts
        # 127.0.0.1, which would let any local client name another's address).
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=settings.trusted_proxies or None,
    )
    return DrainingServer(config, app.state.shutdown, drain_spool)


def serve_workers(settings: Settings, workers: int) -> int:
    """Run `workers` gateway processes on one listening socket until SIGTERM or SIGINT;
    the exit status.

    Each worker is a whole gateway: it claims a spool directory of its own under
    `RTRL_DATA_DIR/spool` (or one a stopped gateway left), adopts free ones, and drains on
    SIGTERM, which this process passes on before it waits for them. A worker that dies is
    replaced, and its replacement carries on with the spool it left; one that dies within
    `WORKER_STARTUP_S` of its start stops them all (exit status 1), as its replacements
    would fail the same way.
    """
    listening = uvicorn.Config(
        "app.main:create_app", host=settings.gateway_host, port=settings.gateway_port
    ).bind_socket()
    context = multiprocessing.get_context("spawn")
    stop_requested = threading.Event()

    def start() -> tuple[SpawnProcess, float]:
        process = context.Process(
            target=_serve_worker, args=(settings, listening), name="rtrl-gateway-worker"
        )
        process.start()
        log.info("gateway worker %d started", process.pid)
        return process, time.monotonic()

    def pass_on(signum: int, frame: FrameType | None) -> None:
        stop_requested.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, pass_on)
    running = [start() for _ in range(workers)]
    status = 0
    while not stop_requested.wait(0.25):
        for index, (process, started) in enumerate(running):
            if process.is_alive():
                continue
            if time.monotonic() - started < WORKER_STARTUP_S:
                log.error(
                    "gateway worker %d exited %s while starting; stopping",
                    process.pid,
                    process.exitcode,
                )
                status = 1
                stop_requested.set()
                break
            log.warning("gateway worker %d exited %s; replacing it", process.pid, process.exitcode)
            running[index] = start()
    for process, _ in running:
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGTERM)
    for process, _ in running:
        process.join()
    listening.close()
    return status


def _serve_worker(settings: Settings, listening: socket.socket) -> None:
    """One process of `serve_workers`."""
    configure_logging()
    _draining_server(settings).run(sockets=[listening])


async def healthz() -> dict[str, str]:
    """The process is up."""
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    """Ready while this process can take requests: not shutting down, and its events are safe
    (Kafka takes them or its spool can hold them). Postgres, Redis and vLLM are shared by every
    gateway, so their state is reported, not judged: a blip of one must not take every gateway
    out of a load balancer at once (this one still answers known keys without Postgres, and a
    request no replica can answer is a 503 of its own)."""
    state = app_state(request.app)
    sink = state.sink
    shutdown: Shutdown = request.app.state.shutdown

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
    dependencies = dict(zip(("database", "redis", "vllm"), results, strict=True))
    stopping = shutdown.started
    # Events are safe while either Kafka takes them or the spool can hold them.
    checks = {
        "events": sink.kafka_connected or sink.spool_can_hold,
        "accepting": not stopping,
    }
    ready = all(checks.values())
    body = {
        "status": "shutting_down" if stopping else "ready" if ready else "unavailable",
        "checks": checks,
        "failing": [name for name, ok in checks.items() if not ok],
        "dependencies": dependencies,
        "degraded": [name for name, ok in dependencies.items() if not ok],
        "kafka_connected": sink.kafka_connected,
        "pid": os.getpid(),
        "spool": str(sink.disk.directory),
        "spooled_events": sink.depth,
        "spool_free_bytes": sink.spool_free_bytes,
        "spool_retained": sink.retained,
    }
    return JSONResponse(body, status_code=200 if ready else 503)


async def metrics() -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
