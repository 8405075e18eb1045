"""`POST /v1/messages`, as the Anthropic Messages API has it: Claude Code's only surface.

The request is translated into the gateway's one internal call, a chat completion
(`ChatCall`; the translation both ways: `app.gateway.anthropic`), and the answer back into a
Message or its server-sent events: the completion is logged, A/B assigned and linked into its
run exactly as a chat request is, and `max_tokens` is held to chat's cap. The session is
`X-Claude-Code-Session-Id` (else `X-Session-Id`, else derived as for chat); the other headers
are every surface's (`app.gateway.headers`), and `anthropic-beta` and `anthropic-version` are
accepted and have no effect. Errors come in Anthropic's shape (`app.http.errors`).

`POST /v1/messages/count_tokens` counts a request's prompt as the served model's chat template
renders it.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.auth.schemas import Principal
from app.gateway.anthropic import anthropic_message, chat_body, in_anthropic_terms, message_events
from app.gateway.chat import OFF_LOOP_BODY_BYTES, CallHeaders, chat_call
from app.gateway.headers import served_headers
from app.gateway.in_flight import released_after
from app.gateway.schemas import ChatRequest
from app.gateway.upstream import BROKEN, UpstreamBusy, UpstreamUnavailable
from app.http.bodies import json_object, parse_body
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.routes import DirectRoute
from app.http.state import app_state
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

TOKENIZE_PATH = "/tokenize"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def messages(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An Anthropic Message, streaming or not, served by the user's checkpoint."""
    received_at, started = datetime.now(UTC), time.perf_counter()
    state = app_state(request.app)
    gateway, settings = state.gateway, state.settings
    said = CallHeaders.read(request, principal, "x-claude-code-session-id", "x-session-id")
    body, chat = await _chat_body(request)
    call = chat_call(
        said, body, chat, settings, received_at=received_at, started=started, surface="messages"
    )
    request_id, session_id = call.request_id, call.session_id
    request.state.upstream_wait = call.upstream_wait
    stop_sequences = body.get("stop") or []
    release = state.in_flight.admit(principal.key_id)
    streaming = False
    try:
        assignment = await gateway.assign(call.user_hash)
        if chat.stream:
            chunks, assignment = await gateway.open_stream(
                call, assignment, request.is_disconnected
            )
            headers = served_headers(assignment.checkpoint, session_id, _SSE_HEADERS)
            events = message_events(chunks, request_id, assignment.checkpoint, stop_sequences)
            streaming = True
            return StreamingResponse(
                released_after(events, release), media_type="text/event-stream", headers=headers
            )
        content, assignment = await gateway.complete(call, assignment)
        answer = anthropic_message(orjson.loads(content), request_id, stop_sequences)
        return Response(
            orjson.dumps(answer),
            media_type="application/json",
            headers=served_headers(assignment.checkpoint, session_id),
        )
    except ApiError as exc:
        raise in_anthropic_terms(exc) from None
    finally:
        if not streaming:
            release()


# The hot path: its one dependency (the key's role) is called without FastAPI's solving.
router.add_api_route(
    "/messages",
    messages,
    methods=["POST"],
    response_model=None,
    route_class_override=DirectRoute,
)


async def count_tokens(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """The tokens a Messages request's prompt holds, as the served model's chat template
    renders it (vLLM's `/tokenize`); nothing is generated or logged."""
    asked = json_object(await request.body())
    # Counting needs no output budget; the translation asks for one.
    body, _ = await run_in_threadpool(_translated, asked | {"max_tokens": 1})
    gateway = app_state(request.app).gateway
    tokenize = {
        "model": gateway.routing.table.production,
        "messages": body["messages"],
        "add_generation_prompt": True,
    }
    if body.get("tools"):
        tokenize["tools"] = body["tools"]
    try:
        reply = await gateway.upstream.post(TOKENIZE_PATH, tokenize)
    except (UpstreamUnavailable, UpstreamBusy, *BROKEN) as exc:
        raise ApiError.service_unavailable(
            f"The model is unavailable: {exc}. Retry shortly.",
            code="upstream_unavailable",
            retry_after_s=1,
        ) from None
    counted = orjson.loads(reply.body) if reply.status == 200 else {}
    if not isinstance(counted.get("count"), int):
        refused = 400 <= reply.status < 500
        raise ApiError(
            400 if refused else 502,
            "The model server could not count the prompt: "
            + reply.body[:500].decode(errors="replace"),
            type="invalid_request_error" if refused else "api_error",
        )
    return Response(orjson.dumps({"input_tokens": counted["count"]}), media_type="application/json")


router.add_api_route(
    "/messages/count_tokens",
    count_tokens,
    methods=["POST"],
    response_model=None,
    route_class_override=DirectRoute,
)


async def _chat_body(request: Request) -> tuple[dict[str, Any], ChatRequest]:
    """The chat body the request translates to (what vLLM is sent) and as the gateway reads
    it; a large body is read in a worker thread, as for chat (`OFF_LOOP_BODY_BYTES`)."""
    raw = await request.body()
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return _read_chat_body(raw)
    return await run_in_threadpool(_read_chat_body, raw)


def _read_chat_body(raw: bytes) -> tuple[dict[str, Any], ChatRequest]:
    return _translated(json_object(raw))


def _translated(asked: dict[str, Any]) -> tuple[dict[str, Any], ChatRequest]:
    body = chat_body(asked)
    chat = parse_body(
        body,
        ChatRequest,
        status=400,
        code="invalid_value",
        message="Invalid {where}: {error}",
        skip_union_members=True,
    )
    return body, chat
