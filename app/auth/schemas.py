"""Who is calling (the authenticated API key), and what a new key is made of."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from app.models import Role


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated API key; a snapshot cached for a few seconds, never the ORM row."""

    key_id: uuid.UUID
    name: str
    role: Role
    privacy_mode: bool
    rate_limit_per_minute: int | None
    expires_at: datetime | None


MAX_RATE_LIMIT_PER_MINUTE = 1_000_000
"""The most requests a minute a key may be given, through `/admin` or the CLI."""


class ApiKeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=200)
    role: Role
    privacy_mode: bool = False
    rate_limit_per_minute: int | None = Field(default=None, ge=1, le=MAX_RATE_LIMIT_PER_MINUTE)
    expires_at: AwareDatetime | None = None
