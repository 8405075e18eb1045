"""Managing API keys: issue (the secret shown once, only its hash stored), revoke, list."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.auth.schemas import ApiKeyCreate
from app.auth.service import create_api_key
from app.models import ApiKey, AuditEntry
from app.registry.audit import Actor, RegistryError, audit


def _key_state(row: ApiKey) -> dict[str, Any]:
    return {
        "id": str(row.id),
        "name": row.name,
        "role": row.role.value,
        "key_prefix": row.key_prefix,
        "privacy_mode": row.privacy_mode,
        "rate_limit_per_minute": row.rate_limit_per_minute,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
    }


async def issue_api_key(
    session: AsyncSession, spec: ApiKeyCreate, actor: Actor
) -> tuple[ApiKey, str]:
    """A new key and its secret (shown once; only the hash is stored)."""
    row, secret = await create_api_key(
        session,
        name=spec.name,
        role=spec.role,
        privacy_mode=spec.privacy_mode,
        rate_limit_per_minute=spec.rate_limit_per_minute,
        expires_at=spec.expires_at,
        created_by=actor.name,
    )
    await session.refresh(row)
    audit(session, actor, "api_key.create", f"api_key:{row.id}", None, _key_state(row))
    await session.flush()
    return row, secret


async def revoke_api_key(session: AsyncSession, key_id: uuid.UUID, actor: Actor) -> AuditEntry:
    """Revoke a key; gateways stop accepting it within their authentication cache's TTL."""
    row = await session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        raise RegistryError(404, "api_key_not_found", f"API key {key_id} does not exist.")
    if row.revoked_at is not None:
        raise RegistryError(409, "api_key_revoked", f"API key {key_id} is already revoked.")
    before = _key_state(row)
    row.revoked_at = datetime.now(UTC)
    entry = audit(session, actor, "api_key.revoke", f"api_key:{row.id}", before, _key_state(row))
    await session.flush()
    return entry


async def list_api_keys(session: AsyncSession, include_revoked: bool) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at.desc())
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list((await session.scalars(query)).all())
