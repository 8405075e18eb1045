"""Issuing and authenticating API keys against the session's Postgres."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.pool import NullPool

from app.auth.service import Authenticator, AuthError, create_api_key
from app.config import Settings
from app.db import make_async_engine, session_scope
from app.models import ApiKey, Role


def test_create_api_key_stores_only_the_hash_and_a_display_prefix(
    stack: Any, engine: Engine
) -> None:
    async def create() -> tuple[ApiKey, str]:
        async_engine = make_async_engine(Settings().database_url)
        try:
            async with async_sessionmaker(async_engine, expire_on_commit=False)() as session:
                row, secret = await create_api_key(
                    session, name="laptop", role=Role.analyst, rate_limit_per_minute=5
                )
                await session.commit()
                return row, secret
        finally:
            await async_engine.dispose()

    row, secret = asyncio.run(create())

    assert secret.startswith("rtrl_") and len(secret) > 40
    with session_scope(engine) as session:
        stored = session.scalar(select(ApiKey).where(ApiKey.id == row.id))
        assert stored is not None
        assert stored.key_hash == hashlib.sha256(secret.encode()).hexdigest()
        assert secret.startswith(stored.key_prefix) and len(stored.key_prefix) < 16
        assert stored.role == Role.analyst and stored.rate_limit_per_minute == 5


def authenticate(authenticator: Authenticator, secret: str) -> Any:
    return asyncio.run(authenticator.authenticate(secret))


@pytest.fixture
def authenticator_factory(stack: Any) -> Callable[[float], Authenticator]:
    def make(ttl_s: float) -> Authenticator:
        # No pooled connections: each asyncio.run below has its own event loop.
        engine = make_async_engine(Settings().database_url, poolclass=NullPool)
        return Authenticator(async_sessionmaker(engine), ttl_s=ttl_s)

    return make


def test_unknown_expired_and_revoked_keys_are_refused(
    make_key: Callable[..., Any], engine: Engine, authenticator_factory: Any
) -> None:
    authenticator = authenticator_factory(0.0)
    _, live = make_key(privacy_mode=True)
    _, expired = make_key(expires_at=datetime.now(UTC) - timedelta(seconds=1))
    revoked_row, revoked = make_key()
    with session_scope(engine) as session:
        session.execute(
            update(ApiKey).where(ApiKey.id == revoked_row.id).values(revoked_at=datetime.now(UTC))
        )

    principal = authenticate(authenticator, live)
    assert principal.role == Role.ide and principal.privacy_mode is True
    for secret, reason in (
        ("rtrl_not-a-key", "invalid"),
        ("sk-something-else", "invalid"),
        (expired, "expired"),
        (revoked, "revoked"),
    ):
        with pytest.raises(AuthError, match=reason):
            authenticate(authenticator, secret)


def test_a_cached_key_is_revoked_within_the_cache_ttl(
    make_key: Callable[..., Any], engine: Engine, authenticator_factory: Any
) -> None:
    authenticator = authenticator_factory(1.0)
    row, secret = make_key()
    authenticate(authenticator, secret)
    with session_scope(engine) as session:
        session.execute(
            update(ApiKey).where(ApiKey.id == row.id).values(revoked_at=datetime.now(UTC))
        )

    authenticate(authenticator, secret)  # still cached: revocation is not instant
    time.sleep(1.1)
    with pytest.raises(AuthError):
        authenticate(authenticator, secret)
