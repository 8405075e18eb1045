"""Health, readiness, metrics and logs of a running gateway."""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx
import pytest

from app.observability import JsonFormatter, request_id_var


def test_health_readiness_and_metrics(gateway_server: Any, ide_key: str) -> None:
    assert httpx.get(f"{gateway_server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway_server.url}/readyz")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"events": True, "accepting": True}
    assert ready.json()["dependencies"] == {"database": True, "redis": True, "vllm": True}
    assert ready.json()["failing"] == [] and ready.json()["degraded"] == []
    httpx.get(f"{gateway_server.url}/v1/models", headers={"Authorization": f"Bearer {ide_key}"})

    metrics = httpx.get(f"{gateway_server.url}/metrics").text

    assert 'rtrl_http_requests_total{route="/v1/models",status="200"}' in metrics
    assert 'rtrl_http_request_seconds_bucket{le="0.001",route="/v1/models"}' in metrics
    assert 'rtrl_spool_depth{where="disk"}' in metrics
    assert "rtrl_kafka_connected 1.0" in metrics
    assert "rtrl_spool_retained_bytes" in metrics


def test_log_lines_are_json_with_the_request_id(caplog: pytest.LogCaptureFixture) -> None:
    token = request_id_var.set("r-logged")
    try:
        record = logging.LogRecord(
            "rtrl.test", logging.INFO, __file__, 1, "served %s", ("x",), None
        )
        record.checkpoint = "ckpt-3"
        line = json.loads(JsonFormatter().format(record))
    finally:
        request_id_var.reset(token)

    assert line["message"] == "served x" and line["level"] == "info"
    assert line["request_id"] == "r-logged" and line["checkpoint"] == "ckpt-3"
