"""Who is calling: the authenticated API key as the request handlers see it."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

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
