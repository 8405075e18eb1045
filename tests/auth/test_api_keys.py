"""Issuing and authenticating API keys against the session's Postgres."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Engine, func, select, update
from sqlalchemy.ext.asyncio import async_sessionmaker
from sqlalchemy.pool import NullPool
from typer.testing import CliRunner

from app.auth.service import (
    Authenticator,
    AuthError,
    AuthThrottled,
    create_api_key,
    hash_secret,
)
from app.config import Settings
from app.db import make_async_engine, session_scope
from app.models import ApiKey, Role
from rtrl.cli import cli


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


def test_an_unknown_key_is_looked_up_once_and_cannot_push_known_keys_out(
    make_key: Callable[..., Any], stack: Any
) -> None:
    engine = make_async_engine(Settings().database_url, poolclass=NullPool)
    authenticator = Authenticator(async_sessionmaker(engine), ttl_s=60.0, max_entries=2)
    _, known = make_key()
    authenticate(authenticator, known)
    lookups = authenticator.lookups

    for _ in range(3):
        with pytest.raises(AuthError):
            authenticate(authenticator, "rtrl_never-issued")
    for n in range(5):  # a flood of distinct unknown keys, each one lookup
        with pytest.raises(AuthError):
            authenticate(authenticator, f"rtrl_guess-{n}")

    assert authenticator.lookups == lookups + 1 + 5
    authenticate(authenticator, known)
    assert authenticator.lookups == lookups + 6  # the known key is still cached


def test_forgetting_one_key_keeps_the_others_cached(
    make_key: Callable[..., Any], stack: Any
) -> None:
    engine = make_async_engine(Settings().database_url, poolclass=NullPool)
    authenticator = Authenticator(async_sessionmaker(engine), ttl_s=60.0)
    first_row, first = make_key()
    _, second = make_key()
    authenticate(authenticator, first)
    authenticate(authenticator, second)
    lookups = authenticator.lookups

    authenticator.forget(first_row.id)
    authenticate(authenticator, second)
    authenticate(authenticator, first)

    assert authenticator.lookups == lookups + 1


def test_an_address_that_keeps_failing_waits_while_others_go_on(
    make_key: Callable[..., Any], stack: Any
) -> None:
    engine = make_async_engine(Settings().database_url, poolclass=NullPool)
    authenticator = Authenticator(async_sessionmaker(engine), failures_per_minute=3, ttl_s=0.5)
    _, known = make_key()
    _, in_use = make_key()
    # A developer behind the same NAT as the guesser, whose key this replica has seen ...
    assert asyncio.run(authenticator.authenticate(in_use, "203.0.113.7")).role == Role.ide
    # ... though not in the last moments: its cached answer is stale, the key still in use.
    time.sleep(0.6)
    for n in range(3):
        with pytest.raises(AuthError):
            asyncio.run(authenticator.authenticate(f"rtrl_guess-{n}", "203.0.113.7"))
    lookups = authenticator.lookups

    with pytest.raises(AuthThrottled) as throttled:
        asyncio.run(authenticator.authenticate("rtrl_guess-next", "203.0.113.7"))
    # A key never seen from there waits with its address (it costs a lookup, as a guess does).
    with pytest.raises(AuthThrottled):
        asyncio.run(authenticator.authenticate(known, "203.0.113.7"))

    assert 1 <= throttled.value.retry_after_s <= 60
    assert authenticator.lookups == lookups
    # Others' failures never lock out a key in use.
    assert asyncio.run(authenticator.authenticate(in_use, "203.0.113.7")).role == Role.ide
    assert asyncio.run(authenticator.authenticate(known, "198.51.100.2")).role == Role.ide


def test_the_cli_creates_a_key_with_a_rate_limit_of_its_own(stack: Any, engine: Engine) -> None:
    """A simulated population shares one key: the operator raises its limit at creation."""
    arguments = ["keys", "create", "--name", "simulator", "--role", "ide"]
    result = CliRunner().invoke(cli, [*arguments, "--rate-limit", "20000"])
    assert result.exit_code == 0, result.output
    secret = result.output.strip()
    with session_scope(engine) as session:
        row = session.scalars(select(ApiKey).where(ApiKey.key_hash == hash_secret(secret))).one()
        assert (row.role, row.rate_limit_per_minute) == (Role.ide, 20000)

    with session_scope(engine) as session:
        before = session.scalar(select(func.count()).select_from(ApiKey))
    refused = CliRunner().invoke(cli, [*arguments, "--rate-limit", "0"])
    assert refused.exit_code == 2
    assert "--rate-limit" in refused.output
    with session_scope(engine) as session:
        assert session.scalar(select(func.count()).select_from(ApiKey)) == before
