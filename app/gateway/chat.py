"""`POST /v1/chat/completions`, as the OpenAI Chat Completions API has it.

The gateway's own calls are chat completions (`app.gateway.service`): this surface reads the
request as one (`ChatCall`) and answers with what vLLM sent, its logging fields hidden. The
headers it reads are every surface's (`app.gateway.headers`). The body's `model` is ignored:
the gateway picks the checkpoint (A/B assignment), and the response's `model` names the
checkpoint that answered.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.abtest.assignment import hash_user
from app.auth.schemas import Principal
from app.config import Settings
from app.events import Surface
from app.gateway.headers import derived_session_id, flag_header, id_header, served_headers
from app.gateway.in_flight import released_after
from app.gateway.schemas import ChatRequest
from app.gateway.service import ChatCall
from app.gateway.toolcalls import looks_like_edit_request
from app.http.bodies import json_object, parse_body
from app.http.dependencies import require_role
from app.http.routes import DirectRoute
from app.http.state import app_state
from app.models import Role
from app.signals.side_requests import side_request

router = APIRouter(prefix="/v1", tags=["gateway"])

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def chat_completions(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OpenAI chat completion, streaming or not, served by the user's checkpoint."""
    received_at, started = datetime.now(UTC), time.perf_counter()
    state = app_state(request.app)
    gateway, settings = state.gateway, state.settings
    said = CallHeaders.read(request, principal, "x-session-id")
    body, chat = await _chat_body(request)
    call = chat_call(said, body, chat, settings, received_at=received_at, started=started)
    session_id = call.session_id
    request.state.upstream_wait = call.upstream_wait
    release = state.in_flight.admit(principal.key_id)
    streaming = False
    try:
        assignment = await gateway.assign(call.user_hash)
        if chat.stream:
            chunks, assignment = await gateway.open_stream(
                call, assignment, request.is_disconnected
            )
            headers = served_headers(assignment.checkpoint, session_id, _SSE_HEADERS)
            streaming = True
            return StreamingResponse(
                released_after(chunks, release), media_type="text/event-stream", headers=headers
            )
        content, assignment = await gateway.complete(call, assignment)
        return Response(
            content,
            media_type="application/json",
            headers=served_headers(assignment.checkpoint, session_id),
        )
    finally:
        if not streaming:
            release()


# The hot path: its one dependency (the key's role) is called without FastAPI's solving.
router.add_api_route(
    "/chat/completions",
    chat_completions,
    methods=["POST"],
    response_model=None,
    route_class_override=DirectRoute,
)


@dataclass(frozen=True, slots=True)
class CallHeaders:
    """What a surface's request says about itself in its headers, read before its body."""

    request: Request
    principal: Principal
    given_session_id: str | None
    client_request_id: str | None
    user_id: str

    @classmethod
    def read(cls, request: Request, principal: Principal, *session_headers: str) -> CallHeaders:
        """The headers every surface reads; the session id from the first of
        `session_headers` the client sent."""
        given = next(
            (found for name in session_headers if (found := id_header(request, name))), None
        )
        return cls(
            request,
            principal,
            given,
            id_header(request, "x-request-id"),
            id_header(request, "x-user-id", max_length=256) or str(principal.key_id),
        )


def chat_call(
    headers: CallHeaders,
    body: dict[str, Any],
    chat: ChatRequest,
    settings: Settings,
    *,
    received_at: datetime,
    started: float,
    surface: Surface = "chat",
) -> ChatCall:
    """The one internal call a surface's request becomes (`body`: the chat body vLLM is sent)."""
    request, principal = headers.request, headers.principal
    user_id = headers.user_id
    session_id = headers.given_session_id or derived_session_id(
        principal.key_id, user_id, chat.messages
    )
    max_tokens_asked = clamped_to_cap(chat, body, settings.max_completion_tokens)
    edit_header = flag_header(request, "x-rtrl-edit-request")
    return ChatCall(
        request=chat,
        body=body,
        session_id=session_id,
        request_id=headers.client_request_id or request.state.request_id,
        client_request_id=headers.client_request_id is not None,
        user_hash=hash_user(settings.user_hash_secret.get_secret_value(), user_id),
        api_key_id=principal.key_id,
        privacy=principal.privacy_mode or bool(flag_header(request, "x-rtrl-privacy")),
        edit_requested=(
            edit_header if edit_header is not None else looks_like_edit_request(chat.messages)
        ),
        received_at=received_at,
        started=started,
        parent_request_id=id_header(request, "x-rtrl-parent-request-id"),
        edit_requested_explicitly=edit_header is not None,
        max_tokens_asked=max_tokens_asked,
        surface=surface,
        side_request=side_request(chat.messages),
    )


async def _chat_body(request: Request) -> tuple[dict[str, Any], ChatRequest]:
    """The body as it came (forwarded to vLLM) and as the gateway reads it. A large body is
    read in a worker thread: checking tool schemas never seen before can cost a second or two
    (`MAX_REQUEST_SCHEMA_NODES`), and the event loop keeps answering meanwhile."""
    raw = await request.body()
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return _read_chat_body(raw)
    return await run_in_threadpool(_read_chat_body, raw)


OFF_LOOP_BODY_BYTES = 64 * 1024
"""Bodies at least this large are parsed and their tool schemas checked off the event loop;
smaller ones cost less than handing them to a thread."""


def _read_chat_body(raw: bytes) -> tuple[dict[str, Any], ChatRequest]:
    body = json_object(raw)
    chat = parse_body(
        body,
        ChatRequest,
        status=400,
        code="invalid_value",
        message="Invalid {where}: {error}",
        skip_union_members=True,
    )
    return body, chat


def clamped_to_cap(chat: ChatRequest, body: dict[str, Any], cap: int) -> int | None:
    """Hold the request to the tokens one completion may have: a larger `max_tokens` or
    `max_completion_tokens` (coding agents ask 32,000 by default, and some exit on a 400) is
    lowered to the cap in what vLLM is sent; returns the largest limit asked, if lowered. A
    request that names no limit is held to the cap by the vLLM rtrl starts."""
    asked = None
    for param in ("max_completion_tokens", "max_tokens"):
        value = getattr(chat, param)
        if value is not None and value > cap:
            asked = max(asked or 0, value)
            setattr(chat, param, cap)
            body[param] = cap
    return asked
