"""`POST /v1/adapters/continue`: Continue's data destination, pointed at rtrl.

In Continue's `config.yaml`:

    data:
      - name: rtrl
        destination: https://rtrl.example.com/v1/adapters/continue
        schema: 0.2.0          # or 0.1.0
        level: all             # or noCode: then edits and chat feedback cannot be joined
        apiKey: <an ide key>
        requestOptions:
          headers:
            X-User-Id: <the developer's stable id, as sent with the model requests>

Every event is answered 202 with what became of it (mapped, duplicate, unjoinable, ignored),
and counted in `rtrl_continue_events_total`; only a body that is not a Continue event is a 4xx.

`POST /v1/adapters/otlp/v1/logs` and `/v1/adapters/otlp/v1/metrics`: an OTLP/HTTP receiver for
Claude Code's telemetry export, pointed at rtrl:

    CLAUDE_CODE_ENABLE_TELEMETRY=1
    OTEL_LOGS_EXPORTER=otlp
    OTEL_METRICS_EXPORTER=otlp
    OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf        # or http/json
    OTEL_EXPORTER_OTLP_ENDPOINT=https://rtrl.example.com/v1/adapters/otlp
    OTEL_EXPORTER_OTLP_HEADERS="Authorization=Bearer <an ide key>"

Its edit decisions become `edit_accepted` or `edit_rejected` on the call they decided
(`app.client_events.decisions`); every export is answered as OTLP expects, in its own encoding,
with the decisions that could not be joined counted as rejected, and its records counted in
`rtrl_otlp_records_total`.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request, Response
from opentelemetry.proto.collector.logs.v1.logs_service_pb2 import (
    ExportLogsPartialSuccess,
    ExportLogsServiceRequest,
    ExportLogsServiceResponse,
)
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsPartialSuccess,
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from redis.exceptions import RedisError

from app.abtest.assignment import hash_user
from app.auth.schemas import Principal
from app.client_events.decisions import Joined, Signal, accept_decisions, count_unused
from app.client_events.otlp import (
    JSON,
    PROTOBUF,
    Decision,
    Read,
    Unreadable,
    decoded,
    encoded,
    encoding_of,
    inflated,
    log_decisions,
    metric_decisions,
)
from app.client_events.schemas import ContinueEnvelope, ContinueEventOutcome
from app.client_events.service import Owner, accept_continue_event
from app.feedback.service import FeedbackLimits
from app.gateway.trajectories import run_owner
from app.http.bodies import parse_body
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.state import app_state
from app.models import Role

router = APIRouter(prefix="/v1/adapters", tags=["feedback"])

_NOT_AN_ENVELOPE = (
    '{where}: {error} (expected Continue\'s {{"name", "data", "schema", "level"}} envelope)'
)


@router.post("/continue", status_code=202, response_model=ContinueEventOutcome)
async def post_continue_event(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> ContinueEventOutcome:
    """One event of Continue's data destination, joined to the completion it is about.

    `toolUsage` of an edit tool (by its tool call id), `nextEditOutcome` (by its completion
    id), `editOutcome` and `chatFeedback` (by the answer's text, level `all` only) become
    `edit_accepted`, `edit_rejected` or a dissatisfied (thumbs down) or satisfied (thumbs up)
    follow-up; everything else is answered `ignored`. The same event posted twice is counted
    once.
    """
    state = app_state(request.app)
    settings = state.settings
    envelope = parse_body(await request.body(), ContinueEnvelope, message=_NOT_AN_ENVELOPE)
    owner = _owner(request, principal)
    try:
        return await accept_continue_event(
            state.redis,
            state.sink,
            owner,
            envelope.name,
            envelope.data,
            FeedbackLimits.from_settings(settings),
        )
    except RedisError:
        raise ApiError.service_unavailable(
            "The event cannot be joined right now; Continue does not retry, so it is lost.",
            code="redis_unavailable",
            retry_after_s=1,
        ) from None


def _owner(request: Request, principal: Principal) -> Owner:
    """Who posted the events: the key, its user (X-User-Id) and whether they are private."""
    settings = app_state(request.app).settings
    user_id = request.headers.get("x-user-id") or str(principal.key_id)
    return Owner(
        api_key_id=principal.key_id,
        run_owner=run_owner(
            principal.key_id, hash_user(settings.user_hash_secret.get_secret_value(), user_id)
        ),
        privacy=principal.privacy_mode or request.headers.get("x-rtrl-privacy") == "1",
    )


_OTLP_BODY = {
    "content": {
        PROTOBUF: {"schema": {"type": "string", "format": "binary"}},
        JSON: {"schema": {"type": "object"}},
    },
    "required": True,
}


@router.post(
    "/otlp/v1/logs",
    response_class=Response,
    openapi_extra={"requestBody": _OTLP_BODY},
    responses={200: {"content": {PROTOBUF: {}, JSON: {}}}},
)
async def post_otlp_logs(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OTLP/HTTP logs export: on an edit tool's call, Claude Code's
    `claude_code.tool_decision` refusal becomes `edit_rejected`, and the
    `claude_code.tool_result` of a permitted call `edit_accepted` (applied) or `edit_rejected`
    (not applicable); an `accept` decision is a permission, not a verdict. Other records are
    accepted and ignored. Answered with an `ExportLogsServiceResponse`, whose partial success
    counts the verdicts that could not be joined."""
    encoding, body = await _otlp_body(request)
    export = decoded(body, encoding, ExportLogsServiceRequest)
    reads = log_decisions(export)
    joined = await _joined(request, principal, "logs", reads)
    rejected, reason = _rejected(reads, joined)
    response = ExportLogsServiceResponse()
    if rejected:
        response.partial_success.CopyFrom(
            ExportLogsPartialSuccess(rejected_log_records=rejected, error_message=reason)
        )
    return Response(encoded(response, encoding), media_type=_MEDIA[encoding])


@router.post(
    "/otlp/v1/metrics",
    response_class=Response,
    openapi_extra={"requestBody": _OTLP_BODY},
    responses={200: {"content": {PROTOBUF: {}, JSON: {}}}},
)
async def post_otlp_metrics(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OTLP/HTTP metrics export: Claude Code's `claude_code.code_edit_tool.decision`
    counter's refusals become `edit_rejected` on the calls it counts (those a `tool_decision`
    event did not already bring; its acceptances are permissions, not verdicts); other
    metrics are accepted and ignored.
    Answered with an `ExportMetricsServiceResponse`, whose partial success counts the data
    points that could not be joined."""
    encoding, body = await _otlp_body(request)
    export = decoded(body, encoding, ExportMetricsServiceRequest)
    reads, others = metric_decisions(export)
    count_unused("metrics", ignored=others, unjoinable=0)
    joined = await _joined(request, principal, "metrics", reads)
    rejected, reason = _rejected(reads, joined)
    response = ExportMetricsServiceResponse()
    if rejected:
        response.partial_success.CopyFrom(
            ExportMetricsPartialSuccess(rejected_data_points=rejected, error_message=reason)
        )
    return Response(encoded(response, encoding), media_type=_MEDIA[encoding])


_MEDIA = {"protobuf": PROTOBUF, "json": JSON}


async def _otlp_body(request: Request) -> tuple[Literal["protobuf", "json"], bytes]:
    encoding = encoding_of(request.headers.get("content-type"))
    body = inflated(
        await request.body(),
        request.headers.get("content-encoding"),
        app_state(request.app).settings.max_request_bytes,
    )
    return encoding, body


async def _joined(
    request: Request, principal: Principal, signal: Signal, reads: list[Read]
) -> list[Joined]:
    state = app_state(request.app)
    decisions = [read for read in reads if isinstance(read, Decision)]
    count_unused(
        signal,
        ignored=sum(read is None for read in reads),
        unjoinable=sum(isinstance(read, Unreadable) for read in reads),
    )
    try:
        return await accept_decisions(
            state.redis,
            state.sink,
            _owner(request, principal),
            signal,
            decisions,
            limits=FeedbackLimits.from_settings(state.settings),
            skew_s=state.settings.feedback_clock_skew.total_seconds(),
        )
    except RedisError:
        raise ApiError.service_unavailable(
            "The export cannot be joined right now; send it again.",
            code="redis_unavailable",
            retry_after_s=1,
        ) from None


def _rejected(reads: list[Read], joined: list[Joined]) -> tuple[int, str]:
    """How many records could not be used, and why (the first reason)."""
    reasons = [read.reason for read in reads if isinstance(read, Unreadable)]
    reasons += [j.reason or "" for j in joined if j.unjoinable]
    return len(reasons), reasons[0] if reasons else ""
