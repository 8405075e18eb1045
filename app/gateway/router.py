"""`POST /v1/chat/completions` and `GET /v1/models`, as the OpenAI API has them.

Headers the gateway reads:
  Authorization: Bearer <key>   an `ide` key.
  X-Session-Id                  optional; the IDE session, key of the logged events. An IDE
                                that sends none (Continue, Cline, Roo, Aider, Zed configured
                                with a base URL and a key) gets one derived from its key, its
                                user and the conversation's first user message
                                (`derived_session_id`), returned in X-Rtrl-Session-Id.
  X-Request-Id                  optional; unique forever (a reused one is answered 409 at
                                any age, since a completion is never replayed); generated if
                                absent and always returned in the response header.
  X-User-Id                     optional; the IDE's stable user id (default: the key's id).
  X-Rtrl-Privacy: 1             optional; no content is logged (also a per-key setting).
  X-Rtrl-Edit-Request: 1|0      optional; whether the user asked for an edit (default: what
                                the agent run's first turn was asked, judged by a heuristic
                                over its user message).
  X-Rtrl-Parent-Request-Id      optional; the request this turn continues (default: the
                                completion whose messages and answer this history extends).
The body's `model` is ignored: the gateway picks the checkpoint (A/B assignment), and the
response's `model` names the checkpoint that answered.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from app.abtest.assignment import hash_user
from app.auth.schemas import Principal
from app.config import Settings
from app.gateway.in_flight import InFlight, released_after
from app.gateway.schemas import ChatRequest, ModelCard, ModelList
from app.gateway.service import ChatCall, Gateway
from app.gateway.toolcalls import looks_like_edit_request, message_text
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.routes import DirectRoute
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

ROUTED_MODEL = "rtrl"
"""The one model the gateway lists; any `model` value is accepted and routed the same."""

# The event schema's alphabet for ids: nothing that could smuggle a header or a log line.
_ID_CHARS = re.compile(r"[A-Za-z0-9._:@-]+")
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.get("/models", response_model=ModelList)
async def list_models(_: Principal = Depends(require_role(Role.ide))) -> ModelList:
    """The routed model clients should name; which checkpoint answers is the gateway's call."""
    return ModelList(data=[ModelCard(id=ROUTED_MODEL)])


async def chat_completions(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OpenAI chat completion, streaming or not, served by the user's checkpoint."""
    received_at, started = datetime.now(UTC), time.perf_counter()
    gateway: Gateway = request.app.state.gateway
    settings: Settings = request.app.state.settings
    given_session_id = _id_header(request, "x-session-id")
    client_request_id = _id_header(request, "x-request-id")
    request_id = client_request_id or request.state.request_id
    user_id = _id_header(request, "x-user-id", max_length=256) or str(principal.key_id)
    body, chat = await _chat_body(request)
    session_id = given_session_id or derived_session_id(principal.key_id, user_id, chat.messages)
    _within_completion_cap(chat, settings.max_completion_tokens)
    edit_header = _flag_header(request, "x-rtrl-edit-request")
    call = ChatCall(
        request=chat,
        body=body,
        session_id=session_id,
        request_id=request_id,
        client_request_id=client_request_id is not None,
        user_hash=hash_user(settings.user_hash_secret.get_secret_value(), user_id),
        api_key_id=principal.key_id,
        privacy=principal.privacy_mode or bool(_flag_header(request, "x-rtrl-privacy")),
        edit_requested=(
            edit_header if edit_header is not None else looks_like_edit_request(chat.messages)
        ),
        received_at=received_at,
        started=started,
        parent_request_id=_id_header(request, "x-rtrl-parent-request-id"),
        edit_requested_explicitly=edit_header is not None,
    )
    request.state.upstream_wait = call.upstream_wait
    in_flight: InFlight = request.app.state.in_flight
    release = in_flight.admit(principal.key_id)
    streaming = False
    try:
        assignment = await gateway.assign(call.user_hash)
        if chat.stream:
            chunks, assignment = await gateway.open_stream(
                call, assignment, request.is_disconnected
            )
            headers = _served_headers(assignment.checkpoint, session_id, _SSE_HEADERS)
            streaming = True
            return StreamingResponse(
                released_after(chunks, release), media_type="text/event-stream", headers=headers
            )
        content, assignment = await gateway.complete(call, assignment)
        return Response(
            content,
            media_type="application/json",
            headers=_served_headers(assignment.checkpoint, session_id),
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


def _served_headers(
    checkpoint: str, session_id: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    return {"X-Rtrl-Checkpoint": checkpoint, "X-Rtrl-Session-Id": session_id, **(extra or {})}


async def _chat_body(request: Request) -> tuple[dict[str, Any], ChatRequest]:
    raw = await request.body()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_json")
    try:
        return body, ChatRequest.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        # Union members (e.g. "literal['none','auto']") name no field of the body.
        parts = [str(part) for part in error["loc"] if "[" not in str(part)]
        param = ".".join(parts) or None
        raise ApiError(
            400, f"Invalid {param or 'body'}: {error['msg']}", code="invalid_value", param=param
        ) from None


def _within_completion_cap(chat: ChatRequest, cap: int) -> None:
    """400 when the request asks for more tokens than one completion may have; one that
    names no limit is held to it by the vLLM rtrl starts (its default max_tokens)."""
    for param in ("max_completion_tokens", "max_tokens"):
        asked = getattr(chat, param)
        if asked is not None and asked > cap:
            raise ApiError(
                400,
                f"{param} is too large: {asked}. This gateway serves at most {cap} completion "
                "tokens per request.",
                code="invalid_value",
                param=param,
            )


def derived_session_id(
    api_key_id: uuid.UUID, user_id: str, messages: Sequence[dict[str, Any]]
) -> str:
    """The session of a request that names none: one per key, user and conversation, the
    conversation known by its first user message (every turn re-sends the history, so every
    turn of it has the same one). Two conversations that open with the same message are one
    session; their runs are still told apart by the run lookup."""
    first = next((m for m in messages if m.get("role") == "user"), messages[0])
    opening = message_text(first)
    digest = hashlib.blake2b(
        f"{api_key_id}\0{user_id}\0{opening}".encode(errors="replace"), digest_size=16
    )
    return f"auto-{digest.hexdigest()}"


def _id_header(request: Request, name: str, *, max_length: int = 128) -> str | None:
    value = request.headers.get(name)
    if value is None:
        return None
    if len(value) > max_length or not _ID_CHARS.fullmatch(value):
        raise ApiError(
            400,
            f"The {_title(name)} header must be 1-{max_length} characters of A-Z a-z 0-9 . _ : @ -",
            code="invalid_header",
            param=_title(name),
        )
    return value


def _flag_header(request: Request, name: str) -> bool | None:
    value = request.headers.get(name)
    if value is None:
        return None
    if value not in ("0", "1"):
        raise ApiError(
            400, f"The {_title(name)} header must be 0 or 1.", code="invalid_header", param=name
        )
    return value == "1"


def _title(name: str) -> str:
    return "-".join("Id" if part == "id" else part.capitalize() for part in name.split("-"))
