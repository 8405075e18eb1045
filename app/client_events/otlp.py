"""OTLP/HTTP bodies, and the edit decisions Claude Code's telemetry export carries in them.

Claude Code exports OpenTelemetry logs and metrics to any OTLP endpoint (`http/protobuf` or
`http/json`). Three signals say what became of an edit the model proposed: the
`claude_code.tool_decision` event (a log record: `tool_name`, `decision` accept|reject,
`source`, `event.timestamp`, `tool_use_id` from v2.1 on), the `claude_code.tool_result` event
(`tool_name`, `success`, `decision`, the same ids) and the `claude_code.code_edit_tool.decision`
counter (`tool_name`, `decision`, `source`, `language`, delta temporality by default). All
carry `session.id`, the session Claude Code also sends as `X-Claude-Code-Session-Id`.

An `accept` is a permission given before the edit runs, not its outcome: an edit permitted
and then not applicable ("String to replace not found") was not kept. So a refusal is read
from the decision (event or counter), and an acceptance only from the tool's result: applied
(`success` true) is `edit_accepted`, failed (`success` false) is `edit_rejected`.

Only those named attributes are read: prompts, tool parameters and every other attribute an
export carries are never looked at, kept or logged.
"""

from __future__ import annotations

import base64
import hashlib
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal, TypeVar

import orjson
from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import ExportLogsServiceRequest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric, NumberDataPoint

from app.http.errors import ApiError
from app.signals.tools import is_edit_tool

MessageT = TypeVar("MessageT", bound=Message)
Encoding = Literal["protobuf", "json"]

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
TOOL_DECISION = "tool_decision"
TOOL_RESULT = "tool_result"
CODE_EDIT_DECISION = "claude_code.code_edit_tool.decision"
_HEX_IDS = frozenset({"traceId", "spanId", "trace_id", "span_id"})
"""OTLP/JSON writes these bytes fields as hex, where protobuf's JSON mapping has base64."""


@dataclass(frozen=True, slots=True)
class Decision:
    """One developer's verdict on one edit tool call, as Claude Code exported it."""

    session_id: str
    tool_name: str
    accepted: bool
    source: str
    """Where Claude Code says the decision came from (config, hook, user_temporary, ...)."""
    at: float
    """When it was made (seconds since the epoch, the client's clock); for a counter, the
    end of the window it counts."""
    identity: str | None = None
    """What tells this event apart from any other (its `tool_use_id`, or its time and
    sequence): the same event exported twice has the same identity. None for a counter."""
    tool_use_id: str | None = None
    window_start: float | None = None
    """A counter's window is `(window_start, at]`."""
    count: int = 1
    event: str = "code_edit_decision"
    """What brought it: `tool_decision`, `tool_result` or the counter (`code_edit_decision`)."""

    @property
    def feedback_source(self) -> str:
        """The feedback's `source`, told apart from what the conversation says (`history:`)."""
        return f"otlp:claude-code:{self.event}"


@dataclass(frozen=True, slots=True)
class Unreadable:
    """A record that is an edit decision but cannot be joined to anything, and why."""

    reason: str


Read = Decision | Unreadable | None
"""What one record or data point says: a decision, one that cannot be used, or nothing rtrl
reads (any other event or metric, or a decision on a tool that does not edit)."""


def encoding_of(content_type: str | None) -> Encoding:
    """The body's encoding from its Content-Type; 415 for anything OTLP/HTTP does not use."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == PROTOBUF:
        return "protobuf"
    if media == JSON:
        return "json"
    raise ApiError(
        415,
        f"Content-Type {media or 'none'!r} is not OTLP/HTTP: send {PROTOBUF} (http/protobuf) "
        f"or {JSON} (http/json).",
        code="unsupported_media_type",
    )


def inflated(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body without its gzip `Content-Encoding` (the OTLP exporters' one compression),
    held to `max_bytes` once inflated."""
    coding = (content_encoding or "identity").strip().lower()
    if coding == "identity":
        return body
    if coding != "gzip":
        raise ApiError(
            415,
            f"Content-Encoding {coding!r} is not supported: send gzip or none.",
            code="bad_encoding",
        )
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        raw = inflater.decompress(body, max_bytes + 1)
    except zlib.error as exc:
        raise ApiError(400, f"The body is not valid gzip: {exc}", code="invalid_otlp") from None
    if len(raw) > max_bytes:
        raise ApiError(
            413,
            f"The inflated body is over {max_bytes} bytes.",
            type="request_too_large",
            code="request_too_large",
        )
    return raw


def decoded(body: bytes, encoding: Encoding, message: type[MessageT]) -> MessageT:
    """The body as the OTLP request `message`; 400 naming what is wrong when it is not one."""
    request = message()
    signal = message.DESCRIPTOR.name
    try:
        if encoding == "protobuf":
            request.ParseFromString(body)
        else:
            parsed = orjson.loads(body)
            if not isinstance(parsed, dict):
                raise json_format.ParseError("the body is not a JSON object")
            json_format.ParseDict(_base64_ids(parsed), request, ignore_unknown_fields=True)
    except (DecodeError, orjson.JSONDecodeError, json_format.ParseError) as exc:
        raise ApiError(
            400,
            f"The body is not an OTLP {signal} in {encoding}: {exc or 'it does not parse'}",
            code="invalid_otlp",
        ) from None
    return request


def encoded(response: Message, encoding: Encoding) -> bytes:
    """An OTLP response in the request's encoding."""
    if encoding == "protobuf":
        return response.SerializeToString()
    return orjson.dumps(json_format.MessageToDict(response))


def _base64_ids(value: Any) -> Any:
    """OTLP/JSON with its hex trace and span ids as protobuf's JSON mapping reads bytes."""
    if isinstance(value, list):
        return [_base64_ids(item) for item in value]
    if not isinstance(value, dict):
        return value
    converted = {}
    for key, item in value.items():
        if key in _HEX_IDS and isinstance(item, str):
            try:
                item = base64.b64encode(bytes.fromhex(item)).decode()
            except ValueError:
                raise json_format.ParseError(f"{key} {item!r} is not hex") from None
        converted[key] = _base64_ids(item)
    return converted


def log_decisions(request: ExportLogsServiceRequest) -> list[Read]:
    """What each log record of the export says (in order), read as `read_edit_event`."""
    reads: list[Read] = []
    for resource_logs in request.resource_logs:
        resource = _attributes(resource_logs.resource.attributes)
        for scope_logs in resource_logs.scope_logs:
            for record in scope_logs.log_records:
                attributes = resource | _attributes(record.attributes)
                name = record.event_name or _text(record.body) or str(attributes.get("event.name"))
                reads.append(
                    read_edit_event(
                        name, attributes, record.time_unix_nano or record.observed_time_unix_nano
                    )
                )
    return reads


def read_edit_event(name: str, attributes: Mapping[str, Any], time_unix_nano: int) -> Read:
    """The verdict on an edit a `claude_code.tool_decision` (a refusal) or
    `claude_code.tool_result` (applied or not) event carries, if it is one."""
    event = name.removeprefix("claude_code.")
    if event not in (TOOL_DECISION, TOOL_RESULT):
        return None
    decision = _decision(attributes, event)
    if decision is None:
        return None
    tool_name, accepted, source = decision
    session_id = attributes.get("session.id")
    at = _iso_seconds(attributes.get("event.timestamp")) or time_unix_nano / 1e9
    tool_use_id = attributes.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not tool_use_id:
        tool_use_id = None
    if not isinstance(session_id, str) or not session_id:
        if tool_use_id is None:
            return Unreadable(f"a {event} without session.id or tool_use_id")
        session_id = ""
    if not at:
        return Unreadable(f"a {event} without event.timestamp or a time")
    identity = (
        f"u:{event}:{tool_use_id}" if tool_use_id else _identity(event, attributes, time_unix_nano)
    )
    return Decision(
        session_id,
        tool_name,
        accepted,
        source,
        at,
        identity=identity,
        tool_use_id=tool_use_id,
        event=event,
    )


def metric_decisions(request: ExportMetricsServiceRequest) -> tuple[list[Read], int]:
    """Claude Code's `code_edit_tool.decision` data points of the export, summed over what
    sets series of one session, tool, decision and source apart (the file's language), and
    the number of data points of every other metric."""
    totals: dict[tuple[str, str, bool, str, float, float], int] = {}
    reads: list[Read] = []
    others = 0
    for resource_metrics in request.resource_metrics:
        resource = _attributes(resource_metrics.resource.attributes)
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                if metric.name != CODE_EDIT_DECISION:
                    others += _point_count(metric)
                    continue
                for point in metric.sum.data_points:
                    read = _counted_decision(resource | _attributes(point.attributes), point)
                    if not isinstance(read, Decision):
                        reads.append(read)
                        continue
                    key = (
                        read.session_id,
                        read.tool_name,
                        read.accepted,
                        read.source,
                        read.window_start or 0.0,
                        read.at,
                    )
                    totals[key] = totals.get(key, 0) + read.count
    reads += [
        Decision(session, tool, accepted, source, end, window_start=start, count=count)
        for (session, tool, accepted, source, start, end), count in totals.items()
        if count > 0
    ]
    return reads, others


def _counted_decision(attributes: Mapping[str, Any], point: NumberDataPoint) -> Read:
    decision = _decision(attributes, "code_edit_decision")
    if decision is None:
        return None
    tool_name, accepted, source = decision
    session_id = attributes.get("session.id")
    if not isinstance(session_id, str) or not session_id:
        return Unreadable("a code_edit_tool.decision without session.id")
    count = point.as_int if point.HasField("as_int") else round(point.as_double)
    if not point.time_unix_nano:
        return Unreadable("a code_edit_tool.decision without a time")
    return Decision(
        session_id,
        tool_name,
        accepted,
        source,
        point.time_unix_nano / 1e9,
        window_start=point.start_time_unix_nano / 1e9,
        count=max(count, 0),
    )


def _decision(attributes: Mapping[str, Any], event: str) -> tuple[str, bool, str] | None:
    """(tool, accepted, source) of a verdict on an edit tool's call; None for anything else.

    A decision (event or counter) is a verdict when it refuses; its `accept` is a permission,
    which the tool's result follows with the outcome. A result is a verdict when the call was
    permitted: applied (`success` true) or not (false); a refused call's result repeats the
    refusal its decision brought."""
    tool_name, decision = attributes.get("tool_name"), attributes.get("decision")
    if not isinstance(tool_name, str) or not is_edit_tool(tool_name):
        return None
    source = attributes.get("source")
    source = source if isinstance(source, str) else ""
    if event != TOOL_RESULT:
        return (tool_name, False, source) if decision == "reject" else None
    if decision == "reject":
        return None
    success = attributes.get("success")
    if success in (True, "true"):
        return tool_name, True, source
    if success in (False, "false"):
        return tool_name, False, source
    return None


def _point_count(metric: Metric) -> int:
    kind = metric.WhichOneof("data")
    return len(getattr(metric, kind).data_points) if kind else 0


def _identity(event: str, attributes: Mapping[str, Any], time_unix_nano: int) -> str:
    """An event's identity without a tool_use_id: its name, session, time and sequence."""
    parts = (
        event,
        attributes.get("session.id"),
        attributes.get("event.timestamp"),
        attributes.get("event.sequence"),
        attributes.get("tool_name"),
        attributes.get("decision"),
        time_unix_nano,
    )
    digest = hashlib.blake2b(orjson.dumps(parts, default=str), digest_size=16)
    return "e:" + digest.hexdigest()


def _attributes(pairs: Iterable[KeyValue]) -> dict[str, Any]:
    """Attributes with a plain value (string, bool, number); arrays and maps are left out."""
    found: dict[str, Any] = {}
    for pair in pairs:
        kind = pair.value.WhichOneof("value")
        if kind in ("string_value", "bool_value", "int_value", "double_value"):
            found[pair.key] = getattr(pair.value, kind)
    return found


def _text(value: AnyValue) -> str:
    return value.string_value if value.WhichOneof("value") == "string_value" else ""


def _iso_seconds(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.fromisoformat(value)
    except ValueError:
        return None
    return (moment if moment.tzinfo else moment.replace(tzinfo=UTC)).timestamp()
