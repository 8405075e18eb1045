"""History tests: a migrated database of their own, emptied (partitions too) before each test."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, text

from app.db import upgrade_schema
from app.events import CompletionEvent
from app.history.partitions import drop_partition, list_partitions
from rtrl.embedded.stack import EmbeddedStack
from tests.workers.conftest import Events
from workers.config import WorkerConfig
from workers.repository import make_worker_engine
from workers.store import feedback_row, sample_row, store_events

EMPTIED = (
    "samples, rewards, feedback_events, erased_users, erased_sessions, checkpoints, "
    "hourly_rollups, experiment_users, experiment_user_days, user_days, experiment_latency, "
    "experiment_latency_groups, rolled_up_rewards, rollup_state, audit_log"
)


def fresh_database(stack: EmbeddedStack) -> Iterator[str]:
    """A new database in the session's Postgres, migrated to head; its URL."""
    name = f"rtrl_history_{uuid.uuid4().hex[:8]}"
    admin = f"postgresql://postgres@127.0.0.1:{stack.postgres.port}/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"postgresql+psycopg://postgres@127.0.0.1:{stack.postgres.port}/{name}"
    upgrade_schema(url)
    try:
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def history_url(stack: EmbeddedStack) -> Iterator[str]:
    yield from fresh_database(stack)


@pytest.fixture
def history_engine(history_url: str) -> Iterator[Engine]:
    """The history database with no rows and no day partitions."""
    engine = make_worker_engine(history_url)
    empty(engine)
    yield engine
    engine.dispose()


def empty(engine: Engine) -> None:
    with engine.begin() as conn:
        conn.execute(text(f"TRUNCATE {EMPTIED} CASCADE"))
        for table in ("rewards", "feedback_events", "samples"):
            for partition in list_partitions(conn, table):
                drop_partition(conn, table, partition.name)


@pytest.fixture
def events() -> Events:
    return Events(prefix=f"h{uuid.uuid4().hex[:8]}", served_at=datetime(2026, 1, 1))


def store(engine: Engine, *batch: Any, now: datetime) -> None:
    """Store events as the worker does."""
    completions = [e for e in batch if isinstance(e, CompletionEvent)]
    feedback = [e for e in batch if not isinstance(e, CompletionEvent)]
    with engine.begin() as conn:
        store_events(
            conn,
            [sample_row(e) for e in completions],
            [feedback_row(e) for e in feedback],
            WorkerConfig(),
            now=now,
        )


def served(events: Events, n: int, user: str, at: datetime, **fields: Any) -> list[Any]:
    """A completion of `user` at `at`, accepted, kept and its session ended: a final reward."""
    at_events = Events(events.prefix, at)
    return [
        at_events.completion(n, user_hash=user, **fields),
        at_events.accepted(n),
        at_events.survival(n, 900, 1.0),
        at_events.followup(n, "thanks, works"),
        at_events.session_end(n, after_s=1000),
    ]


def table_rows(engine: Engine, table: str) -> list[dict[str, Any]]:
    """Every row of a history table, in key order, as plain dicts."""
    order = {"samples": "id", "feedback_events": "id", "rewards": "sample_id"}[table]
    with engine.connect() as conn:
        return [
            dict(row._mapping)
            for row in conn.execute(text(f"SELECT * FROM {table} ORDER BY {order}"))
        ]


def partition_of(engine: Engine, table: str) -> Callable[[str, Any], set[str]]:
    """Which partitions hold the rows whose `column` equals a value."""

    def find(column: str, value: Any) -> set[str]:
        with engine.connect() as conn:
            return set(
                conn.execute(
                    text(f"SELECT tableoid::regclass::text FROM {table} WHERE {column} = :v"),
                    {"v": value},
                ).scalars()
            )

    return find
