"""`GET /v1/models`, as the OpenAI API has it: what every surface's clients may name.

Each API surface is a module of its own beside this one (`app.gateway.chat`,
`app.gateway.messages`, `app.gateway.responses`), served by `app.gateway.surfaces`.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from app.auth.schemas import Principal
from app.gateway.schemas import ModelCard, ModelList
from app.http.dependencies import require_role
from app.models import Role

router = APIRouter(prefix="/v1", tags=["gateway"])

ROUTED_MODEL = "rtrl"
"""The one model the gateway lists; any `model` value is accepted and routed the same."""


@router.get("/models", response_model=ModelList)
async def list_models(_: Principal = Depends(require_role(Role.ide))) -> ModelList:
    """The routed model clients should name; which checkpoint answers is the gateway's call."""
    return ModelList(data=[ModelCard(id=ROUTED_MODEL)])
