"""`POST /v1/adapters/otlp/v1/{logs,metrics}`: Claude Code's telemetry export lands its edit
decisions on the calls they decided."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from google.protobuf.message import Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.logs.v1.logs_pb2 import LogRecord, ResourceLogs, ScopeLogs
from opentelemetry.proto.metrics.v1.metrics_pb2 import (
    AggregationTemporality,
    Metric,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from sqlalchemy import Engine

from app.auth.service import new_api_key
from app.db import session_scope
from app.models import Role

LOGS, METRICS = "/v1/adapters/otlp/v1/logs", "/v1/adapters/otlp/v1/metrics"
EDIT_SCHEMA = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}},
    "required": ["file_path"],
}
SCOPE = InstrumentationScope(name="com.anthropic.claude_code", version="2.1.0")
RESOURCE = Resource(
    attributes=[
        KeyValue(key="service.name", value=AnyValue(string_value="claude-code")),
        KeyValue(key="host.arch", value=AnyValue(string_value="amd64")),
    ]
)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def attributes(**values: str) -> list[KeyValue]:
    return [
        KeyValue(key=name.replace("__", "."), value=AnyValue(string_value=value))
        for name, value in values.items()
    ]


def nanos(at: float) -> int:
    return int(at * 1e9)


def iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


def tool_decision(session: str, at: float, decision: str, **extra: str) -> LogRecord:
    """A `claude_code.tool_decision` record as Claude Code's logs exporter writes it."""
    return LogRecord(
        time_unix_nano=nanos(at),
        observed_time_unix_nano=nanos(at),
        body=AnyValue(string_value="claude_code.tool_decision"),
        attributes=attributes(
            session__id=session,
            user__id="4b9f2e",
            event__name="tool_decision",
            event__timestamp=iso(at),
            event__sequence=str(int(at * 1000)),
            tool_name="Edit",
            decision=decision,
            source="user_temporary" if decision == "accept" else "user_reject",
            **extra,
        ),
    )


def tool_result(session: str, at: float, success: bool, **extra: str) -> LogRecord:
    """A `claude_code.tool_result` record: the permitted Edit ran, and applied or failed."""
    return LogRecord(
        time_unix_nano=nanos(at),
        body=AnyValue(string_value="claude_code.tool_result"),
        attributes=attributes(
            **{
                "session__id": session,
                "event__name": "tool_result",
                "event__timestamp": iso(at),
                "event__sequence": str(int(at * 1000) + 1),
                "tool_name": "Edit",
                "success": "true" if success else "false",
                "duration_ms": "12",
                "decision": "accept",
                "source": "user_temporary",
                "tool_parameters": '{"file_path": "/home/dev/secret.py"}',
            }
            | extra
        ),
    )


def logs_export(*records: LogRecord) -> ExportLogsServiceRequest:
    return ExportLogsServiceRequest(
        resource_logs=[
            ResourceLogs(
                resource=RESOURCE, scope_logs=[ScopeLogs(scope=SCOPE, log_records=records)]
            )
        ]
    )


def edit_decisions(
    session: str, *windows: tuple[float, float, str, int]
) -> ExportMetricsServiceRequest:
    """`claude_code.code_edit_tool.decision` data points (delta, Claude Code's default), one per
    (start, end, decision, count), beside a metric rtrl does not read."""
    points = [
        NumberDataPoint(
            start_time_unix_nano=nanos(start),
            time_unix_nano=nanos(end),
            as_int=count,
            attributes=attributes(
                session__id=session,
                tool_name="Edit",
                decision=decision,
                source="user_temporary" if decision == "accept" else "user_reject",
                language="Python",
            ),
        )
        for start, end, decision, count in windows
    ]
    delta = AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA
    metrics = [
        Metric(
            name="claude_code.code_edit_tool.decision",
            sum=Sum(data_points=points, aggregation_temporality=delta, is_monotonic=True),
        ),
        Metric(
            name="claude_code.token.usage",
            unit="tokens",
            sum=Sum(
                data_points=[NumberDataPoint(time_unix_nano=nanos(time.time()), as_int=12)],
                aggregation_temporality=delta,
            ),
        ),
    ]
    return ExportMetricsServiceRequest(
        resource_metrics=[
            ResourceMetrics(
                resource=RESOURCE, scope_metrics=[ScopeMetrics(scope=SCOPE, metrics=metrics)]
            )
        ]
    )


def post(client: TestClient, path: str, export: Message, encoding: str, key: str) -> Message:
    """Post an export as the OTLP/HTTP exporter does, and read the answer in its encoding."""
    response_type = ExportLogsServiceResponse if path == LOGS else ExportMetricsServiceResponse
    if encoding == "protobuf":
        body, media = export.SerializeToString(), "application/x-protobuf"
    else:
        # OTLP/JSON: camelCase, and trace and span ids in hex (none here), 64-bit ints as text.
        body, media = orjson.dumps(json_format.MessageToDict(export)), "application/json"
    posted = client.post(path, content=body, headers={**auth(key), "Content-Type": media})
    assert posted.status_code == 200, posted.text
    assert posted.headers["content-type"] == media
    answer = response_type()
    if encoding == "protobuf":
        answer.ParseFromString(posted.content)
    else:
        json_format.Parse(posted.text, answer)
    return answer


@pytest.fixture
def edit(client: TestClient, ide_key: str) -> Callable[[str], dict[str, Any]]:
    """A Messages turn of Claude Code's session whose answer called Edit: its ids and when
    it was answered."""

    def serve(session: str) -> dict[str, Any]:
        for _ in range(3):  # the tiny model now and then writes no call that parses
            request_id = f"r-{uuid.uuid4().hex[:12]}"
            response = client.post(
                "/v1/messages",
                json={
                    "model": "claude",
                    "max_tokens": 160,
                    "messages": [{"role": "user", "content": "Fix add() in calc.py."}],
                    "tools": [
                        {"name": "Edit", "description": "Edit a file.", "input_schema": EDIT_SCHEMA}
                    ],
                    "tool_choice": {"type": "tool", "name": "Edit"},
                },
                headers={
                    **auth(ide_key),
                    "X-Claude-Code-Session-Id": session,
                    "X-Request-Id": request_id,
                },
            )
            assert response.status_code == 200, response.text
            calls = [b for b in response.json()["content"] if b["type"] == "tool_use"]
            if len(calls) == 1:
                time.sleep(0.05)  # the turn is remembered beside the answer, not before it
                return {"request_id": request_id, "call_id": calls[0]["id"], "at": time.time()}
        raise AssertionError("the model made no Edit call in three turns that named it")

    return serve


def verdicts(
    client: TestClient, key: str, feedback_topic: Any, since: Any, session: str, *turns: str
) -> dict[str, list[tuple[str, str]]]:
    """The edit verdicts published on these turns (request ids) since `since`; a session end
    sent last marks the end of what to read."""
    sentinel = str(uuid.uuid4())
    ended = client.post(
        "/v1/feedback",
        json={
            "events": [
                {
                    "event_id": sentinel,
                    "kind": "session_end",
                    "session_id": session,
                    "request_id": turns[-1],
                }
            ]
        },
        headers=auth(key),
    )
    assert ended.status_code == 202, ended.text
    found: dict[str, list[tuple[str, str]]] = {}
    for event in feedback_topic.read_until(since, sentinel):
        if event["kind"] in ("edit_accepted", "edit_rejected") and event["request_id"] in turns:
            found.setdefault(event["request_id"], []).append((event["kind"], event["source"]))
    return found


@pytest.mark.parametrize("encoding", ["protobuf", "json"])
def test_claude_codes_decisions_land_once_on_the_edit_they_decided(
    client: TestClient,
    ide_key: str,
    edit: Callable[[str], dict[str, Any]],
    feedback_topic: Any,
    encoding: str,
) -> None:
    session = str(uuid.uuid4())
    first = edit(session)
    failed = edit(session)
    second = edit(session)
    since = feedback_topic.mark()
    # The first edit permitted and applied, and the next permitted and not applicable, each
    # before the next edit was served (named by time only, as Claude Code before
    # tool_use_id); the last refused, named by its tool_use_id as well.
    accepted_at, failed_at, rejected_at = first["at"], failed["at"], second["at"] + 0.01
    export = logs_export(
        # A permission is not a verdict: what the result says is.
        tool_decision(session, accepted_at, "accept"),
        tool_result(session, accepted_at + 0.001, success=True),
        tool_decision(session, failed_at, "accept"),
        tool_result(session, failed_at + 0.001, success=False, error="String to replace not found"),
        tool_decision(session, rejected_at, "reject", tool_use_id=second["call_id"]),
        # A refused call's result repeats its refusal: read once, from the decision.
        tool_result(
            session,
            rejected_at + 0.001,
            success=False,
            decision="reject",
            source="user_reject",
            tool_use_id=second["call_id"],
        ),
        tool_decision(str(uuid.uuid4()), rejected_at, "reject"),  # a session never served
        LogRecord(
            time_unix_nano=nanos(rejected_at),
            body=AnyValue(string_value="claude_code.user_prompt"),
            attributes=attributes(session__id=session, prompt="my secret plan"),
        ),
    )
    answer = post(client, LOGS, export, encoding, ide_key)
    assert answer.partial_success.rejected_log_records == 1
    assert "no Edit call" in answer.partial_success.error_message
    # Sent again (a retried export), and counted by the metrics exporter too: nothing new.
    again = post(client, LOGS, export, encoding, ide_key)
    assert again.partial_success.rejected_log_records == 1
    counted = edit_decisions(
        session,
        (accepted_at - 30, rejected_at + 1, "accept", 1),
        (accepted_at - 30, rejected_at + 1, "reject", 1),
    )
    assert not post(client, METRICS, counted, encoding, ide_key).HasField("partial_success")

    turns = (first["request_id"], failed["request_id"], second["request_id"])
    found = verdicts(client, ide_key, feedback_topic, since, session, *turns)
    assert found == {
        first["request_id"]: [("edit_accepted", "otlp:claude-code:tool_result")],
        failed["request_id"]: [("edit_rejected", "otlp:claude-code:tool_result")],
        second["request_id"]: [("edit_rejected", "otlp:claude-code:tool_decision")],
    }
    metrics = client.get("/metrics").text
    assert 'rtrl_otlp_records_total{outcome="duplicate",signal="metrics"}' in metrics
    assert 'rtrl_otlp_records_total{outcome="ignored",signal="logs"}' in metrics


def test_the_counter_alone_decides_the_latest_edit_once(
    client: TestClient,
    ide_key: str,
    edit: Callable[[str], dict[str, Any]],
    feedback_topic: Any,
) -> None:
    session = str(uuid.uuid4())
    first = edit(session)
    second = edit(session)
    since = feedback_topic.mark()
    now = time.time()
    # One refusal in the window after the second edit was served: it decided the second.
    counted = edit_decisions(session, (second["at"] - 0.01, now, "reject", 1))
    for _ in range(2):  # a retried export counts once
        assert not post(client, METRICS, counted, "json", ide_key).HasField("partial_success")
    # Acceptances counted are permissions, not verdicts: nothing is joined to them.
    permitted = edit_decisions(session, (now, now + 1, "accept", 1))
    assert not post(client, METRICS, permitted, "json", ide_key).HasField("partial_success")
    # Two refusals in the next window: the first edit is the only one left; one is unjoinable.
    later = edit_decisions(session, (now + 1, now + 2, "reject", 2))
    answer = post(client, METRICS, later, "protobuf", ide_key)
    assert answer.partial_success.rejected_data_points == 1

    turns = (first["request_id"], second["request_id"])
    found = verdicts(client, ide_key, feedback_topic, since, session, *turns)
    assert found == {
        second["request_id"]: [("edit_rejected", "otlp:claude-code:code_edit_decision")],
        first["request_id"]: [("edit_rejected", "otlp:claude-code:code_edit_decision")],
    }


def test_what_is_not_an_otlp_export_or_not_an_ide_key_is_refused(
    client: TestClient, ide_key: str, engine: Engine
) -> None:
    protobuf = {**auth(ide_key), "Content-Type": "application/x-protobuf"}
    json = {**auth(ide_key), "Content-Type": "application/json"}
    for path, body, headers, status, words in (
        (LOGS, b"\x0a\xff\xff\xff", protobuf, 400, "not an OTLP ExportLogsServiceRequest"),
        (METRICS, b'{"resourceMetrics": 3}', json, 400, "ExportMetricsServiceRequest in json"),
        (METRICS, b"[]", json, 400, "not a JSON object"),
        (LOGS, b"{", json, 400, "not an OTLP"),
        (LOGS, b"x", {**auth(ide_key), "Content-Type": "text/plain"}, 415, "not OTLP/HTTP"),
        (LOGS, b"", {"Content-Type": "application/x-protobuf"}, 401, ""),
    ):
        posted = client.post(path, content=body, headers=headers)
        assert posted.status_code == status, (path, body, posted.text)
        assert words in posted.json()["error"]["message"]
    with session_scope(engine) as session:
        row, analyst = new_api_key(name=f"test-{uuid.uuid4().hex[:8]}", role=Role.analyst)
        session.add(row)
    refused = client.post(LOGS, content=b"", headers={**protobuf, **auth(analyst)})
    assert refused.status_code == 403, refused.text
