"""Serving an API: its request read as the gateway's one chat call (`ChatCall`), the answer
translated back.

An `ApiSurface` names the translations (none for Chat Completions); `serve` does the rest, the
same for every surface: the headers every surface reads (`CallHeaders`), the call they and the
body make (`chat_call`: the session, the user, privacy, the edit request, `max_tokens` held to
the cap), the A/B arm, vLLM's answer whole or streamed, a body of 64 KB or more read off the
event loop. The completion is logged with its exact token ids and logprobs and linked into its
run by `app.gateway.service`. Chat Completions (`app.gateway.chat`), Anthropic Messages
(`app.gateway.messages`) and OpenAI Responses (`app.gateway.responses`) are surfaces.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from fastapi import Request, Response
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
from app.gateway.translation import Answering
from app.http.bodies import json_object, parse_body
from app.http.errors import ApiError
from app.http.state import app_state
from app.signals.side_requests import side_request

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class ApiSurface:
    """An API served as the one chat call."""

    name: Surface
    session_headers: tuple[str, ...]
    """Where its clients send their session id, first found wins."""
    chat_body: Callable[[dict[str, Any]], dict[str, Any]]
    """The chat body a request asks for; raises `ApiError` (400) for what cannot be served."""
    answer: Callable[[bytes, Answering], bytes]
    """The surface's answer of a whole chat completion (vLLM's JSON, logging fields hidden)."""
    events: Callable[[AsyncIterator[bytes], Answering], AsyncIterator[bytes]]
    """The surface's server-sent events of the chat completion chunks relayed."""
    in_its_terms: Callable[[ApiError], ApiError] = lambda error: error
    """An error as the surface's clients read it (a too-long prompt, above all)."""


async def serve(surface: ApiSurface, request: Request, principal: Principal) -> Response:
    """Serve one request of `surface`, streaming or not, by the user's checkpoint."""
    received_at, started = datetime.now(UTC), time.perf_counter()
    state = app_state(request.app)
    gateway, settings = state.gateway, state.settings
    said = CallHeaders.read(request, principal, *surface.session_headers)
    asked, body, chat = await translated_body(surface, request)
    call = chat_call(
        said, body, chat, settings, received_at=received_at, started=started, surface=surface.name
    )
    request.state.upstream_wait = call.upstream_wait
    release = state.in_flight.admit(principal.key_id)
    streaming = False
    try:
        assignment = await gateway.assign(call.user_hash)
        if chat.stream:
            chunks, assignment = await gateway.open_stream(
                call, assignment, request.is_disconnected
            )
            answering = Answering(call.request_id, assignment.checkpoint, asked, body)
            headers = served_headers(assignment.checkpoint, call.session_id, _SSE_HEADERS)
            events = surface.events(chunks, answering)
            streaming = True
            return StreamingResponse(
                released_after(events, release), media_type="text/event-stream", headers=headers
            )
        content, assignment = await gateway.complete(call, assignment)
        answering = Answering(call.request_id, assignment.checkpoint, asked, body)
        return Response(
            surface.answer(content, answering),
            media_type="application/json",
            headers=served_headers(assignment.checkpoint, call.session_id),
        )
    except ApiError as exc:
        raise surface.in_its_terms(exc) from None
    finally:
        if not streaming:
            release()


async def translated_body(
    surface: ApiSurface, request: Request, **fixed: Any
) -> tuple[dict[str, Any], dict[str, Any], ChatRequest]:
    """The request as asked, the chat body it translates to, and that body as the gateway
    reads it (`fixed`: fields set on the request before translating). A body of
    `OFF_LOOP_BODY_BYTES` or more is read in a worker thread: checking tool schemas never
    seen before can cost a second or two, and the event loop keeps answering meanwhile."""
    raw = await request.body()
    if len(raw) < OFF_LOOP_BODY_BYTES:
        return _translated(surface, raw, fixed)
    return await run_in_threadpool(_translated, surface, raw, fixed)


def _translated(
    surface: ApiSurface, raw: bytes, fixed: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], ChatRequest]:
    asked = json_object(raw) | fixed
    body = surface.chat_body(asked)
    chat = parse_body(
        body,
        ChatRequest,
        status=400,
        code="invalid_value",
        message="Invalid {where}: {error}",
        skip_union_members=True,
    )
    return asked, body, chat


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
    secret = settings.user_hash_secret.get_secret_value()
    session_id = headers.given_session_id or derived_session_id(
        principal.key_id, user_id, chat.messages, secret
    )
    max_tokens_asked = clamped_to_cap(chat, body, settings.max_completion_tokens)
    edit_header = flag_header(request, "x-rtrl-edit-request")
    return ChatCall(
        request=chat,
        body=body,
        session_id=session_id,
        request_id=headers.client_request_id or request.state.request_id,
        client_request_id=headers.client_request_id is not None,
        user_hash=hash_user(secret, user_id),
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


OFF_LOOP_BODY_BYTES = 64 * 1024
"""Bodies at least this large are parsed and their tool schemas checked off the event loop;
smaller ones cost less than handing them to a thread."""


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
