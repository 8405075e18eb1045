"""A gateway's graceful stop: on SIGTERM it reports not ready, refuses new requests, lets the
requests in flight finish and sends its spool to Kafka, all within RTRL_SHUTDOWN_DRAIN, then
exits. What Kafka did not take stays in the spool, for the next gateway on that volume."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from types import FrameType

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from app.http.errors import error_body, error_response

log = logging.getLogger(__name__)

PROBES = frozenset({"/healthz", "/readyz", "/metrics"})


class Shutdown:
    """Whether the gateway is stopping, how long it has left, and the requests in flight."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.deadline: float | None = None
        self.in_flight = 0

    @property
    def started(self) -> bool:
        return self.deadline is not None

    def begin(self) -> None:
        self.deadline = time.monotonic() + self.budget_s

    def remaining_s(self) -> float:
        """The time left to stop in: the whole budget until SIGTERM."""
        if self.deadline is None:
            return self.budget_s
        return max(self.deadline - time.monotonic(), 0.0)


class ShutdownGate:
    """Once stopping, answers every request but the probes 503; counts those in flight."""

    def __init__(self, app: ASGIApp, shutdown: Shutdown) -> None:
        self.app = app
        self.shutdown = shutdown

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in PROBES:
            await self.app(scope, receive, send)
            return
        if self.shutdown.started:
            body = error_body(
                "This gateway is shutting down; retry, another one will answer.",
                type="service_unavailable",
                code="shutting_down",
            )
            response = error_response(503, body, {"Retry-After": "1", "Connection": "close"})
            await response(scope, receive, send)
            return
        self.shutdown.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.shutdown.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn, except that the first SIGTERM drains before the server stops."""

    def __init__(
        self, config: uvicorn.Config, shutdown: Shutdown, drain_spool: Callable[[float], bool]
    ) -> None:
        super().__init__(config)
        self.stopping = shutdown
        self.drain_spool = drain_spool

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.stopping.started:
            self.stopping.begin()
            threading.Thread(target=self._drain, name="rtrl-shutdown", daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        log.info(
            "SIGTERM: not ready, refusing new requests, draining for up to %.0f s",
            self.stopping.budget_s,
        )
        while self.stopping.in_flight and self.stopping.remaining_s():
            time.sleep(0.05)
        sent = self.drain_spool(self.stopping.remaining_s())
        log.info("stopping; spool %s", "sent" if sent else "kept for the next gateway")
        self.should_exit = True
