"""Structured JSON logs that carry the request id, and the HTTP metrics every route shares."""

from __future__ import annotations

import atexit
import logging
import logging.handlers
import queue
import re
import sys
import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

request_id_var: ContextVar[str | None] = ContextVar("request_id", default=None)
access_log = logging.getLogger("rtrl.access")

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:@-]{1,128}")
"""Ids the IDE may send (X-Request-Id, X-Session-Id): the event schema's alphabet."""

HTTP_REQUESTS = Counter(
    "rtrl_http_requests_total", "HTTP requests answered, by route and status.", ["route", "status"]
)
HTTP_LATENCY = Histogram(
    "rtrl_http_request_seconds",
    "Time to the end of the response, by route.",
    ["route"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
HTTP_OVERHEAD = Histogram(
    "rtrl_http_overhead_seconds",
    "The gateway's own time in a request that waited on the model server: time to the "
    "response's first byte less the wait for the model's answer (a stream's first chunk), "
    "by route.",
    ["route"],
    buckets=(
        *(n / 4000 for n in range(1, 17)),  # every 0.25 ms up to 4 ms: the budget is 2 ms
        0.005,
        0.0075,
        0.01,
        0.015,
        0.025,
        0.05,
        0.1,
        0.25,
        1,
    ),
)

# Attributes every LogRecord has; anything else was passed with `extra=` and is logged.
_STANDARD_ATTRS = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, request id and extras."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in record.__dict__.items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: int = logging.INFO) -> None:
    """Root logger → JSON lines on stderr, written by a thread so no request waits on I/O."""
    # Formatted where the record is made, so the line carries that request's id.
    queue_handler = logging.handlers.QueueHandler(queue.SimpleQueue())
    queue_handler.setFormatter(JsonFormatter())
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(queue_handler.queue, writer)
    listener.start()
    atexit.register(listener.stop)
    root = logging.getLogger()
    root.handlers[:] = [queue_handler]
    root.setLevel(level)


@dataclass(slots=True)
class UpstreamWait:
    """When a request asked the model server and when the answer (a stream's first chunk)
    came: the time the gateway only waited. A route that waits puts one in the request's
    state as `upstream_wait`, and `RequestObservability` counts the rest as the gateway's
    own (`rtrl_http_overhead_seconds`)."""

    asked: float | None = None
    answered: float | None = None

    def ask(self) -> None:
        """The model server is asked (a retry on another checkpoint keeps the first time)."""
        if self.asked is None:
            self.asked = time.perf_counter()

    def answer(self) -> None:
        """The answer, or a stream's first chunk, is in."""
        if self.answered is None:
            self.answered = time.perf_counter()

    @property
    def seconds(self) -> float | None:
        """The wait; None unless the model server answered."""
        if self.asked is None or self.answered is None:
            return None
        return self.answered - self.asked


class RequestObservability:
    """Per HTTP request: a request id in the logs and the response, metrics, an access log."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given = _header(scope, b"x-request-id")
        request_id = given if given and REQUEST_ID_PATTERN.fullmatch(given) else new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        status = 500
        first_byte: float | None = None

        async def send_with_request_id(message: Message) -> None:
            nonlocal status, first_byte
            if message["type"] == "http.response.body" and first_byte is None:
                first_byte = time.perf_counter()
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *message.get("headers", []),
                    (b"x-request-id", request_id.encode()),
                ]
            await send(message)

        try:
            await self.app(scope, receive, send_with_request_id)
        finally:
            elapsed = time.perf_counter() - started
            route = _route_template(scope)
            HTTP_REQUESTS.labels(route, str(status)).inc()
            HTTP_LATENCY.labels(route).observe(elapsed)
            wait = scope["state"].get("upstream_wait")
            waited = wait.seconds if isinstance(wait, UpstreamWait) else None
            if waited is not None and first_byte is not None and status == 200:
                HTTP_OVERHEAD.labels(route).observe(max(first_byte - started - waited, 0.0))
            access_log.log(
                _access_level(status),
                "%s %s %d",
                scope["method"],
                scope["path"],
                status,
                extra={"status": status, "route": route, "duration_ms": round(elapsed * 1000, 3)},
            )
            request_id_var.reset(token)


def _access_level(status: int) -> int:
    # Successes are counted by the metrics; a line each would cost more than the routing.
    if status >= 500:
        return logging.WARNING
    return logging.INFO if status >= 400 else logging.DEBUG


def new_request_id() -> str:
    """A fresh request id for a request that did not bring one."""
    return f"req_{uuid.uuid4().hex}"


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def _route_template(scope: Scope) -> str:
    # The template, not the raw path, keeps the label set small.
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
