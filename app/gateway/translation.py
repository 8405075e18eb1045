"""What every surface's translation shares (`app.gateway.surfaces` serves the surfaces)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.http.errors import ApiError


@dataclass(frozen=True, slots=True)
class Answering:
    """What translating an answer back needs besides the answer."""

    request_id: str
    checkpoint: str
    """The checkpoint that answered (the surface's `model`)."""
    asked: dict[str, Any]
    """The request as the client sent it."""
    body: dict[str, Any]
    """The chat body it became (what vLLM was sent)."""


def exceeds_context(error: ApiError) -> bool:
    """Whether `error` is vLLM's refusal of a prompt longer than the model's context."""
    return error.status_code == 400 and "maximum context length" in error.message
