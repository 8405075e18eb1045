"""Prometheus metrics of processes without a web server of their own: workers and trainer."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

from app.config import SettingsError

log = logging.getLogger(__name__)


def serve_metrics(port: int | None) -> None:
    """Serve this process's metrics at :`port`/metrics from a daemon thread; None: nothing."""
    if port is None:
        return
    try:
        start_http_server(port)
    except OSError as exc:
        raise SettingsError(
            f"RTRL_METRICS_PORT={port}: cannot serve metrics there ({exc}); "
            "give each process on a host its own port"
        ) from None
    log.info("metrics at http://0.0.0.0:%d/metrics", port)
