"""Health, readiness, metrics and logs of a running gateway."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.config import Settings
from app.observability import JsonFormatter, request_id_var
from app.processes import free_port


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


def test_a_gateway_whose_spool_disk_is_full_and_kafka_down_is_not_ready(
    gateway_settings: Settings, start_gateway: Callable[[Settings], Any]
) -> None:
    # With Kafka unreachable, events are safe only on the spool's disk. A full disk leaves
    # the directory writable by its permissions; a floor above the disk's free space stands
    # in for a full disk here.
    offline = gateway_settings.model_copy(
        update={"kafka_bootstrap_servers": f"127.0.0.1:{free_port()}"}
    )
    roomy = start_gateway(offline)
    ready = httpx.get(f"{roomy.url}/readyz", timeout=30)
    assert ready.status_code == 200, ready.text
    free = ready.json()["spool_free_bytes"]
    assert free > 0 and ready.json()["kafka_connected"] is False

    full = start_gateway(offline.model_copy(update={"spool_min_free_bytes": free + (1 << 40)}))
    unready = httpx.get(f"{full.url}/readyz", timeout=30)
    assert unready.status_code == 503, unready.text
    assert unready.json()["status"] == "unavailable"
    assert unready.json()["failing"] == ["events"]


CHAT_ROUTE = "/v1/chat/completions"


def route_sums(gateway_url: str) -> dict[str, tuple[float, float]]:
    """(count, sum) of each HTTP time histogram on the chat route."""
    sums: dict[str, tuple[float, float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics").text):
        if family.name not in ("rtrl_http_overhead_seconds", "rtrl_http_request_seconds"):
            continue
        values = {
            sample.name.rsplit("_", 1)[1]: sample.value
            for sample in family.samples
            if sample.labels.get("route") == CHAT_ROUTE and sample.name.endswith(("_count", "_sum"))
        }
        sums[family.name] = (values.get("count", 0.0), values.get("sum", 0.0))
    return sums


def test_the_gateways_own_time_leaves_out_the_models(gateway_server: Any, ide_key: str) -> None:
    """Ops tell a slow gateway from a slow model: each answered chat adds the time to its first
    byte less vLLM's time to answer (a stream's first chunk) to rtrl_http_overhead_seconds."""
    before = route_sums(gateway_server.url)
    headers = {"Authorization": f"Bearer {ide_key}"}
    body = {"model": "rtrl", "messages": [{"role": "user", "content": "Say hi."}]}
    with httpx.Client(base_url=gateway_server.url, headers=headers, timeout=60) as http:
        # Forty tokens keep vLLM busy for far longer than the gateway's own work.
        answered = http.post(CHAT_ROUTE, json=body | {"max_tokens": 40, "ignore_eos": True})
        assert answered.status_code == 200, answered.text
        with http.stream("POST", CHAT_ROUTE, json=body | {"max_tokens": 4, "stream": True}) as s:
            assert s.status_code == 200
            s.read()
        refused = http.post(CHAT_ROUTE, json=body | {"temperature": -1})
        assert refused.status_code == 400
    after = route_sums(gateway_server.url)

    def delta(name: str) -> tuple[float, float]:
        (count_before, sum_before), (count, total) = before.get(name, (0, 0)), after[name]
        return count - count_before, total - sum_before

    overhead_count, overhead_s = delta("rtrl_http_overhead_seconds")
    request_count, request_s = delta("rtrl_http_request_seconds")
    assert (overhead_count, request_count) == (2, 3)  # the refused request waited on nothing
    assert 0 < overhead_s < request_s / 2


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


def _schema_tool(name: str, properties: int) -> dict[str, Any]:
    parameters = {
        "type": "object",
        "properties": {f"{name}_{i}": {"type": "string"} for i in range(properties)},
    }
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_health_checks_are_answered_while_a_request_brings_large_tool_schemas(
    gateway_server: Any, ide_key: str
) -> None:
    # Three tools of 3,000 properties, never seen before: checking them against the JSON
    # Schema metaschema takes seconds, which once held the event loop and every request on it.
    # The request names a tool it does not declare, so it is refused right after the check.
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [_schema_tool(f"{uuid.uuid4().hex[:8]}_{k}", 3_000) for k in range(3)],
        "tool_choice": {"type": "function", "function": {"name": "undeclared"}},
    }
    headers = {"Authorization": f"Bearer {ide_key}"}
    with ThreadPoolExecutor(1) as pool:
        sent = time.monotonic()
        chat = pool.submit(
            httpx.post, f"{gateway_server.url}{CHAT_ROUTE}", json=body, headers=headers, timeout=60
        )
        health: list[tuple[float, float]] = []
        while not chat.done():
            asked = time.monotonic()
            assert httpx.get(f"{gateway_server.url}/healthz", timeout=60).status_code == 200
            health.append((asked, time.monotonic()))
            time.sleep(0.05)
        answered = time.monotonic()
        assert chat.result().status_code == 400
    assert "undeclared" in chat.result().text
    # Health checks sent while the schemas were being checked came back before the refusal.
    assert any(asked > sent + 0.2 and done < answered - 0.5 for asked, done in health), (
        f"chat answered after {answered - sent:.1f} s; health checks (sent, answered after "
        f"the chat was sent): {[(round(a - sent, 2), round(d - sent, 2)) for a, d in health]}"
    )


def test_a_request_whose_tool_schemas_exceed_the_budget_is_refused(
    gateway_server: Any, ide_key: str
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [_schema_tool(f"t{k}", 4_000) for k in range(3)],
    }
    answer = httpx.post(
        f"{gateway_server.url}{CHAT_ROUTE}",
        json=body,
        headers={"Authorization": f"Bearer {ide_key}"},
        timeout=60,
    )
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_value"
    assert "20000 values together (the limit per request)" in error["message"]
