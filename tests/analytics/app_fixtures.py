"""The app with the admin, analytics and dashboard routers, on a database of its own.

A database of their own lets these tests promote, roll back and seed samples without
changing what the other test modules find in the session's shared database. Both
`tests/admin/conftest.py` and `tests/analytics/conftest.py` import these fixtures.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from app.admin.router import router as admin_router
from app.analytics.dashboard import router as dashboard_router
from app.analytics.router import router as analytics_router
from app.auth.service import new_api_key
from app.config import Settings
from app.db import make_engine, session_scope, upgrade_schema
from app.main import create_app
from app.models import Role
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack

# Checkpoint numbers far from those of the shared database, so the `ckpt-<n>` names these
# tests load into the session's vLLM never collide with other tests' adapters.
CHECKPOINT_NUMBERS_FROM = 700_000 + uuid.uuid4().int % 100_000


def include_routers(app: FastAPI) -> FastAPI:
    """Add the admin, analytics and dashboard routes unless `create_app` already has them."""
    paths = {getattr(route, "path", "") for route in app.routes}
    for router, probe in (
        (admin_router, "/admin/checkpoints"),
        (analytics_router, "/analytics/experiments"),
        (dashboard_router, "/dashboard"),
    ):
        if probe not in paths:
            app.include_router(router)
    return app


@pytest.fixture(scope="session")
def app_database(stack: EmbeddedStack) -> Iterator[str]:
    """A freshly migrated database in the session's Postgres; its URL."""
    name = f"rtrl_{uuid.uuid4().hex[:10]}"
    admin = f"postgresql://postgres@127.0.0.1:{stack.postgres.port}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:{stack.postgres.port}/{name}"
    upgrade_schema(url)
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text("SELECT setval('checkpoint_number_seq', :n)"), {"n": CHECKPOINT_NUMBERS_FROM}
        )
    engine.dispose()
    try:
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def app_engine(app_database: str) -> Iterator[Engine]:
    engine = make_engine(app_database)
    yield engine
    engine.dispose()


@pytest.fixture(scope="session")
def app_settings(
    stack: EmbeddedStack, app_database: str, tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    # Nothing listens on this vLLM URL: these tests serve no completions.
    return Settings(
        data_dir=tmp_path_factory.mktemp("admin-app"),
        database_url=app_database,
        vllm_urls=[f"http://127.0.0.1:{free_port()}"],
    )


@pytest.fixture(scope="session")
def client(app_settings: Settings) -> Iterator[TestClient]:
    # Loopback over plain HTTP, as a local browser: the dashboard cookie is not Secure there.
    with TestClient(
        include_routers(create_app(app_settings)), base_url="http://127.0.0.1"
    ) as client:
        yield client


@pytest.fixture
def make_key(app_engine: Engine) -> Callable[..., str]:
    """Creates an API key of a role in the app's database; returns its secret."""

    def make(role: Role = Role.ide, **fields: Any) -> str:
        with session_scope(app_engine) as session:
            row, secret = new_api_key(
                name=f"{role.value}-{uuid.uuid4().hex[:6]}", role=role, **fields
            )
            session.add(row)
        return secret

    return make


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}
