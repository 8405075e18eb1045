"""`rtrl maintain` and `rtrl history import`: retention to Parquet, and the way back."""

from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine, text

from app.abtest.rollups import refresh_rollups
from app.db import session_scope
from app.history.partitions import create_partitions, list_partitions
from app.history.service import import_history, maintain
from app.models import Checkpoint, CheckpointStatus
from rtrl.embedded.stack import EmbeddedStack
from tests.history.conftest import empty, fresh_database, served, store, table_rows
from tests.workers.conftest import Events
from workers.repository import make_worker_engine

NOW = datetime(2026, 3, 20, 12, tzinfo=UTC)
OLD = datetime(2026, 2, 10, 9, tzinfo=UTC)  # past a 30-day retention at NOW
RECENT = datetime(2026, 3, 19, 9, tzinfo=UTC)
HISTORY = ("samples", "rewards", "feedback_events")
KEYS = {"samples": "served_at", "rewards": "served_at", "feedback_events": "occurred_at"}


@pytest.fixture(scope="module")
def other_database(stack: EmbeddedStack) -> Iterator[Engine]:
    """A second, freshly migrated database to import into."""
    for url in fresh_database(stack):
        engine = make_worker_engine(url)
        yield engine
        engine.dispose()


def seed(engine: Engine, events: Events) -> None:
    for n, at in enumerate([OLD, OLD + timedelta(hours=3), OLD + timedelta(days=1), RECENT]):
        store(engine, *served(events, n, f"user-{n % 2}", at), now=at + timedelta(hours=1))


def hourly_rollups(engine: Engine) -> list[tuple[object, ...]]:
    with engine.connect() as conn:
        return [
            tuple(row)
            for row in conn.execute(text("SELECT * FROM hourly_rollups ORDER BY hour, checkpoint"))
        ]


def test_maintain_archives_and_drops_old_days_and_an_import_brings_them_back(
    history_engine: Engine, other_database: Engine, events: Events, tmp_path: Path
) -> None:
    seed(history_engine, events)
    with history_engine.begin() as conn:
        create_partitions(conn, [OLD.date(), (OLD + timedelta(days=1)).date(), RECENT.date()])
    refresh_rollups(history_engine)
    rollups = hourly_rollups(history_engine)
    everything = {table: table_rows(history_engine, table) for table in HISTORY}
    archive = str(tmp_path / "archive")

    report = maintain(history_engine, archive, retention=timedelta(days=30), days_ahead=2, now=NOW)

    with history_engine.connect() as conn:
        days = {p.day for p in list_partitions(conn, "samples")}
    assert days == {RECENT.date(), date(2026, 3, 20), date(2026, 3, 21), date(2026, 3, 22)}
    assert sorted(report.dropped) == sorted(
        f"{table}_p{day:%Y%m%d}"
        for table in HISTORY
        for day in (date(2026, 2, 10), date(2026, 2, 11))
    )
    assert [row["served_at"] for row in table_rows(history_engine, "samples")] == [RECENT]
    assert len(table_rows(history_engine, "rewards")) == 1
    files = sorted(Path(archive).rglob("*.parquet"))
    assert sorted(f.parent.name for f in files if f.parts[-3] == "samples") == [
        "day=2026-02-10",
        "day=2026-02-11",
    ]
    assert sum(pq.read_metadata(f).num_rows for f in files if f.parts[-3] == "samples") == 3
    # The rollups outlive the raw rows: the archived hours are still counted.
    assert refresh_rollups(history_engine) == 0
    assert hourly_rollups(history_engine) == rollups

    empty(other_database)
    imported = import_history(other_database, archive)
    import_history(history_engine, archive)  # back where they came from

    assert imported.inserted == {"samples": 3, "rewards": 3, "feedback_events": 12}
    cutoff = NOW - timedelta(days=30)
    old = {
        table: [row for row in everything[table] if row[KEYS[table]] < cutoff] for table in HISTORY
    }
    assert {table: table_rows(other_database, table) for table in HISTORY} == old
    assert {table: table_rows(history_engine, table) for table in HISTORY} == everything


def test_a_day_the_production_checkpoint_trains_on_is_kept_past_the_retention(
    history_engine: Engine, events: Events, tmp_path: Path
) -> None:
    seed(history_engine, events)
    with session_scope(history_engine) as session:
        session.add(
            Checkpoint(
                name="ckpt-9",
                status=CheckpointStatus.production,
                base_model="tiny",
                published_at=OLD + timedelta(hours=12),
            )
        )

    report = maintain(
        history_engine, str(tmp_path), retention=timedelta(days=30), days_ahead=0, now=NOW
    )

    assert report.kept_for_training == [date(2026, 2, 10), date(2026, 2, 11)]
    assert report.dropped == []
    assert len(table_rows(history_engine, "samples")) == 4
