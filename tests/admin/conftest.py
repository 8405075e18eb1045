"""Admin tests: the app on its own database, reset to just the base model before each test."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.exc import OperationalError

from app.db import session_scope
from app.models import Checkpoint, CheckpointStatus, Role
from app.serving.publish import ensure_base_checkpoint
from tests.analytics import app_fixtures

# The app on a database of its own (see tests/analytics/app_fixtures.py).
app_database = app_fixtures.app_database
app_engine = app_fixtures.app_engine
app_settings = app_fixtures.app_settings
client = app_fixtures.client
make_key = app_fixtures.make_key

REGISTRY_TABLES = (
    "arms, experiments, training_runs, checkpoints, audit_log, control_flags, alerts, "
    "samples, rewards, hourly_rollups, experiment_users, experiment_user_days, user_days, "
    "experiment_latency, experiment_latency_groups, rolled_up_rewards, rollup_state"
)


@pytest.fixture(autouse=True)
def registry(app_engine: Engine) -> Engine:
    """Nothing but the base model, which is production."""
    # The app's routing listener may be reloading the registry after the last test's
    # change; Postgres then breaks the deadlock by failing one side, so try again.
    for attempt in range(5):
        try:
            with app_engine.begin() as conn:
                conn.execute(text(f"TRUNCATE {REGISTRY_TABLES} RESTART IDENTITY CASCADE"))
            break
        except OperationalError:
            if attempt == 4:
                raise
            time.sleep(0.2)
    with session_scope(app_engine) as session:
        ensure_base_checkpoint(session, "tiny-base")
    return app_engine


@pytest.fixture
def add_checkpoint(registry: Engine) -> Callable[..., None]:
    """Registers a checkpoint row (no adapter files: these tests serve nothing)."""

    def add(
        name: str,
        status: CheckpointStatus = CheckpointStatus.candidate,
        parent: str = "base",
        adapter_path: str | None = None,
    ) -> None:
        with session_scope(registry) as session:
            parent_id = session.execute(
                text("SELECT id FROM checkpoints WHERE name = :name"), {"name": parent}
            ).scalar_one()
            session.add(
                Checkpoint(
                    name=name,
                    parent_id=parent_id,
                    status=status,
                    base_model="tiny-base",
                    adapter_path=adapter_path,
                    published_at=datetime.now(UTC),
                )
            )

    return add


@pytest.fixture
def ops_key(make_key: Callable[..., str]) -> str:
    return make_key(Role.ops)


@pytest.fixture
def analyst_key(make_key: Callable[..., str]) -> str:
    return make_key(Role.analyst)
