"""`POST /v1/chat/completions`, as the OpenAI Chat Completions API has it.

The gateway's own calls are chat completions (`app.gateway.service`): this surface needs no
translation (`app.gateway.surfaces`), and answers with what vLLM sent, its logging fields
hidden. The body's `model` is ignored: the gateway picks the checkpoint (A/B assignment), and
the response's `model` names the checkpoint that answered. The session is `X-Session-Id`,
else derived from the conversation (`app.gateway.headers`).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request, Response

from app.auth.schemas import Principal
from app.gateway.surfaces import ApiSurface, serve
from app.http.dependencies import require_role
from app.http.routes import STREAMED_OR_WHOLE, DirectRoute
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

CHAT = ApiSurface(
    name="chat",
    session_headers=("x-session-id",),
    chat_body=lambda asked: asked,
    answer=lambda content, answering: content,
    events=lambda chunks, answering: chunks,
)


async def chat_completions(
    request: Request, principal: Principal = Depends(require_role(Role.ide))
) -> Response:
    """An OpenAI chat completion, streaming or not, served by the user's checkpoint."""
    return await serve(CHAT, request, principal)


# The hot path: its one dependency (the key's role) is called without FastAPI's solving.
router.add_api_route(
    "/chat/completions",
    chat_completions,
    methods=["POST"],
    response_model=None,
    responses=STREAMED_OR_WHOLE,
    route_class_override=DirectRoute,
)
