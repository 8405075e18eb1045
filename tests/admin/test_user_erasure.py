"""`POST /admin/users/erase`: a user's rows gone from Postgres, the archive and the rollups."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine, text

from app.abtest.assignment import hash_user
from app.abtest.rollups import refresh_rollups
from app.config import Settings
from app.history.service import maintain
from tests.analytics.app_fixtures import bearer
from tests.history.conftest import served, store
from tests.workers.conftest import Events

ROLLUPS = (
    "hourly_rollups",
    "experiment_users",
    "experiment_user_days",
    "user_days",
    "experiment_latency",
    "experiment_latency_groups",
    "rolled_up_rewards",
)


@pytest.fixture
def history(registry: Engine) -> Iterator[Engine]:
    with registry.begin() as conn:
        conn.execute(text("TRUNCATE feedback_events, erased_users, erased_sessions"))
    yield registry


def rollups(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    with engine.connect() as conn:
        return {
            table: sorted(tuple(row) for row in conn.execute(text(f"SELECT * FROM {table}")))
            for table in ROLLUPS
        }


def rows_of(engine: Engine, user_hash: str, sessions: set[str]) -> list[int]:
    """The user's samples, their rewards and the feedback of their sessions, counted."""
    with engine.connect() as conn:
        return [
            conn.execute(
                text("SELECT count(*) FROM samples WHERE user_hash = :u"), {"u": user_hash}
            ).scalar_one(),
            conn.execute(
                text(
                    "SELECT count(*) FROM rewards r JOIN samples s ON s.id = r.sample_id "
                    "WHERE s.user_hash = :u"
                ),
                {"u": user_hash},
            ).scalar_one(),
            conn.execute(
                text("SELECT count(*) FROM feedback_events WHERE session_id = ANY(:s)"),
                {"s": sorted(sessions)},
            ).scalar_one(),
        ]


def archived(archive: Path, table: str, column: str, values: set[str]) -> int:
    """Rows of `table` in the archive whose `column` is one of `values`."""
    found = 0
    for path in archive.glob(f"{table}/day=*/*.parquet"):
        found += sum(value in values for value in pq.read_table(path)[column].to_pylist())
    return found


def test_erasing_a_user_leaves_no_row_of_theirs_anywhere(
    client: TestClient, history: Engine, app_settings: Settings, ops_key: str
) -> None:
    secret = app_settings.user_hash_secret.get_secret_value()
    alice, bob = hash_user(secret, "alice@example.com"), hash_user(secret, "bob")
    events = Events(prefix=f"e{uuid.uuid4().hex[:8]}", served_at=datetime.now(UTC))
    now = datetime.now(UTC)
    old, recent = now - timedelta(days=40), now - timedelta(hours=2)
    arm = {"experiment_id": 7, "arm": "treatment"}
    users = {0: alice, 1: bob, 2: alice, 3: bob, 4: alice, 5: alice}
    moments = {0: old, 1: old, 2: recent, 3: recent, 4: recent + timedelta(minutes=1)}
    moments[5] = recent + timedelta(minutes=2)
    for n, at in moments.items():
        store(history, *served(events, n, users[n], at, **arm), now=at + timedelta(hours=1))
    archive = app_settings.data_dir / "archive"
    maintain(history, str(archive), retention=timedelta(days=30), days_ahead=1, now=now)
    assert archived(archive, "samples", "user_hash", {alice}) == 1
    refresh_rollups(history)
    alice_sessions = {events.session(n) for n, user in users.items() if user == alice}
    bob_before = rows_of(history, bob, {events.session(n) for n in (1, 3)})

    ops = ops_key
    answer = client.post(
        "/admin/users/erase", json={"user_id": "alice@example.com"}, headers=bearer(ops)
    )

    assert answer.status_code == 200, answer.text
    erased = answer.json()
    assert erased["user_hash"] == alice
    assert (erased["samples"], erased["rewards"], erased["feedback_events"]) == (3, 3, 12)
    assert (erased["archived_samples"], erased["archived_rewards"]) == (1, 1)
    assert erased["archived_feedback_events"] == 4
    assert rows_of(history, alice, alice_sessions) == [0, 0, 0]
    assert rows_of(history, bob, {events.session(n) for n in (1, 3)}) == bob_before
    assert archived(archive, "samples", "user_hash", {alice}) == 0
    assert archived(archive, "feedback_events", "session_id", alice_sessions) == 0
    assert archived(archive, "samples", "user_hash", {bob}) == 1
    with history.connect() as conn:
        user_rows = conn.execute(
            text(
                "SELECT (SELECT count(*) FROM experiment_users WHERE user_hash = :u) "
                "+ (SELECT count(*) FROM experiment_user_days WHERE user_hash = :u) "
                "+ (SELECT count(*) FROM user_days WHERE user_hash = :u)"
            ),
            {"u": alice},
        ).scalar_one()
    assert user_rows == 0
    # What is left of the rollups is what a rebuild from the remaining rows counts.
    after = rollups(history)
    with history.begin() as conn:
        conn.execute(text("DELETE FROM rollup_state"))
    refresh_rollups(history)
    assert rollups(history) == after
    entries = client.get(
        "/admin/audit", params={"action": "erase_user"}, headers=bearer(ops)
    ).json()
    assert [(e["target"], e["after"]["samples"]) for e in entries] == [(f"user:{alice}", 3)]


def test_only_ops_erase_and_a_bad_user_id_is_refused(
    client: TestClient, history: Engine, ops_key: str, analyst_key: str
) -> None:
    analyst, ops = analyst_key, ops_key
    refused = client.post("/admin/users/erase", json={"user_id": "x"}, headers=bearer(analyst))
    assert refused.status_code == 403
    for body in ({"user_id": ""}, {"user_id": "a b"}, {}, {"user_id": "x", "extra": 1}):
        answer = client.post("/admin/users/erase", json=body, headers=bearer(ops))
        assert answer.status_code == 400, body
        assert answer.json()["error"]["type"] == "invalid_request_error"
