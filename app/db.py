"""Database engines, sessions and schema migrations."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)
from sqlalchemy.orm import Session, sessionmaker

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def alembic_config(database_url: str) -> Config:
    """Alembic configured for `database_url`, independent of the working directory."""
    config = Config(str(PROJECT_ROOT / "alembic.ini"))
    config.set_main_option("script_location", str(PROJECT_ROOT / "migrations"))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade_schema(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision`."""
    command.upgrade(alembic_config(database_url), revision)


def make_engine(database_url: str, **kwargs: object) -> Engine:
    return create_engine(database_url, pool_pre_ping=True, **kwargs)


def make_async_engine(database_url: str, **kwargs: object) -> AsyncEngine:
    return create_async_engine(database_url, pool_pre_ping=True, **kwargs)


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with sessionmaker(engine, expire_on_commit=False)() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


@asynccontextmanager
async def async_session_scope(
    maker: async_sessionmaker[AsyncSession],
) -> AsyncIterator[AsyncSession]:
    """An async session that commits on success and rolls back on error."""
    async with maker() as session:
        try:
            yield session
            await session.commit()
        except BaseException:
            await session.rollback()
            raise
