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

import orjson
from fastapi import APIRouter, Depends, Request, Response

from app.auth.schemas import Principal
from app.gateway.anthropic import anthropic_message, chat_body, in_anthropic_terms, message_events
from app.gateway.body_schemas import MESSAGES_BODY, request_body
from app.gateway.surfaces import ApiSurface, serve, translated_body
from app.gateway.upstream import BROKEN, UpstreamBusy, UpstreamUnavailable
from app.http.dependencies import require_role
from app.http.errors import ApiError
from app.http.routes import STREAMED_OR_WHOLE, DirectRoute
from app.http.state import app_state
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

TOKENIZE_PATH = "/tokenize"

MESSAGES = ApiSurface(
    name="messages",
    session_headers=("x-claude-code-session-id", "x-session-id"),
    chat_body=chat_body,
    answer=lambda content, answering: orjson.dumps(
        anthropic_message(
            orjson.loads(content), answering.request_id, answering.body.get("stop") or []
        )
    ),
    events=lambda chunks, answering: message_events(
        chunks, answering.request_id, answering.checkpoint, answering.body.get("stop") or []
    ),
    in_its_terms=in_anthropic_terms,
)


async def messages(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An Anthropic Message, streaming or not, served by the user's checkpoint."""
    return await serve(MESSAGES, request, principal)


# The hot path: its one dependency (the key's role) is called without FastAPI's solving.
router.add_api_route(
    "/messages",
    messages,
    methods=["POST"],
    response_model=None,
    openapi_extra=request_body(MESSAGES_BODY),
    responses=STREAMED_OR_WHOLE,
    route_class_override=DirectRoute,
)


async def count_tokens(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """The tokens a Messages request's prompt holds, as the served model's chat template
    renders it (vLLM's `/tokenize`); nothing is generated or logged."""
    # Counting needs no output budget; the translation asks for one.
    _, body, _ = await translated_body(MESSAGES, request, max_tokens=1)
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
