"""Serving an API that is not Chat Completions: its request translated into the gateway's one
chat call, the answer translated back.

A `Surface` names the translations; `serve` does the rest as the chat route does: the
completion is logged with its exact token ids and logprobs, A/B assigned and linked into its
run, its `max_tokens` held to the cap, and a body of 64 KB or more read off the event loop.
Anthropic Messages (`app.gateway.messages`) and OpenAI Responses (`app.gateway.responses`)
are surfaces.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from app.auth.schemas import Principal
from app.events import Surface
from app.gateway.chat import OFF_LOOP_BODY_BYTES, CallHeaders, chat_call
from app.gateway.headers import served_headers
from app.gateway.in_flight import released_after
from app.gateway.schemas import ChatRequest
from app.gateway.translation import Answering
from app.http.bodies import json_object, parse_body
from app.http.errors import ApiError
from app.http.state import app_state

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class ApiSurface:
    """An API served as the one chat call."""

    name: Surface
    session_headers: tuple[str, ...]
    """Where its clients send their session id, first found wins."""
    chat_body: Callable[[dict[str, Any]], dict[str, Any]]
    """The chat body a request asks for; raises `ApiError` (400) for what cannot be served."""
    answer: Callable[[dict[str, Any], Answering], dict[str, Any]]
    """The surface's answer of a whole chat completion."""
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
            orjson.dumps(surface.answer(orjson.loads(content), answering)),
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
    `OFF_LOOP_BODY_BYTES` or more is read in a worker thread, as for chat."""
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
