"""The body and answer of `POST /v1/adapters/continue`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ContinueOutcome = Literal["mapped", "duplicate", "unjoinable", "ignored"]
"""mapped: queued as rtrl feedback; duplicate: the same event was queued before; unjoinable:
it carries a signal, but names no completion this key and user were served (or one too old);
ignored: it carries no signal rtrl keeps (autocomplete, token counts, a non-edit tool, ...)."""


class ContinueEnvelope(BaseModel):
    """One event as Continue's data destination posts it (schema 0.1.0 or 0.2.0, level `all`
    or `noCode`); fields Continue adds later are tolerated."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    data: dict[str, Any]
    schema_: str | None = Field(default=None, alias="schema", max_length=16)
    level: str | None = Field(default=None, max_length=16)
    profileId: str | None = Field(default=None, max_length=256)


class ContinueEventOutcome(BaseModel):
    """What became of one Continue event."""

    name: str
    outcome: ContinueOutcome
    feedback: list[str]
    """The rtrl feedback kinds it was mapped onto (empty unless mapped or duplicate)."""
    request_id: str | None
    """The completion it was joined to, when it was."""
    reason: str | None = None
    """Why it was unjoinable or ignored."""
