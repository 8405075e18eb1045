"""Who changed what: the actor of a change, refused changes, and the audit log."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from app.models import AuditEntry


class RegistryError(Exception):
    """A refused change: 404 unknown target, 409 invalid transition, 422 invalid values."""

    def __init__(
        self, status_code: int, code: str, message: str, *, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Actor:
    """Who makes a change: an API key (name and id), or an automatic process by name."""

    name: str
    key_id: uuid.UUID | None = None


def audit(
    session: Session | AsyncSession,
    actor: Actor,
    action: str,
    target: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> AuditEntry:
    """Record a change in the audit log, in the same transaction as the change."""
    entry = AuditEntry(
        actor=actor.name,
        actor_key_id=actor.key_id,
        action=action,
        target=target,
        before=before,
        after=after,
    )
    session.add(entry)
    return entry


def audit_entries(
    session: Session, target: str | None, action: str | None, limit: int
) -> list[AuditEntry]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if target is not None:
        query = query.where(AuditEntry.target == target)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    return list(session.scalars(query))


def audit_of(session: Session, targets: list[str], limit: int) -> list[AuditEntry]:
    """The latest entries about any of `targets`, newest first."""
    query = select(AuditEntry).where(AuditEntry.target.in_(targets))
    return list(session.scalars(query.order_by(AuditEntry.id.desc()).limit(limit)))
