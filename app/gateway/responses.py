"""`POST /v1/responses`, as the OpenAI Responses API has it: Codex's only surface.

The request is translated into the gateway's one internal call, a chat completion (the
translation both ways: `app.gateway.openai_responses`), and the answer back into a Response
or its `response.*` server-sent events: the completion is logged, A/B assigned and linked into
its run exactly as a chat request is, and `max_output_tokens` is held to chat's cap. The
session is `session-id` (Codex sends its thread id there), else `thread-id`, else
`X-Session-Id`, else derived as for chat; the other headers are every surface's
(`app.gateway.headers`). Errors come in OpenAI's shape; a prompt longer than the model's
context is a 400 `context_length_exceeded`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from app.auth.schemas import Principal
from app.gateway.body_schemas import RESPONSES_BODY, request_body
from app.gateway.openai_responses import (
    chat_body,
    in_responses_terms,
    response_body,
    response_events,
)
from app.gateway.surfaces import ApiSurface, serve
from app.http.dependencies import require_role
from app.http.routes import STREAMED_OR_WHOLE, DirectRoute
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

RESPONSES = ApiSurface(
    name="responses",
    session_headers=("session-id", "thread-id", "x-session-id"),
    chat_body=chat_body,
    answer=response_body,
    events=response_events,
    in_its_terms=in_responses_terms,
)


async def responses(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OpenAI Response, streaming or not, served by the user's checkpoint."""
    return await serve(RESPONSES, request, principal)


# The hot path: its one dependency (the key's role) is called without FastAPI's solving.
router.add_api_route(
    "/responses",
    responses,
    methods=["POST"],
    response_model=None,
    openapi_extra=request_body(RESPONSES_BODY),
    responses=STREAMED_OR_WHOLE,
    route_class_override=DirectRoute,
)
