"""Daily partitions: created ahead, and rows that waited in a default partition moved in."""

from datetime import UTC, date, datetime, timedelta

from sqlalchemy import Engine, text

from app.history.partitions import create_ahead, create_partitions, list_partitions
from tests.history.conftest import partition_of, served, store, table_rows
from tests.workers.conftest import Events

DAY = datetime(2026, 3, 4, 10, tzinfo=UTC)


def test_partitions_are_created_ahead_for_every_history_table(history_engine: Engine) -> None:
    with history_engine.begin() as conn:
        created = create_ahead(conn, date(2026, 3, 4), 3)
        again = create_ahead(conn, date(2026, 3, 4), 3)
        days = {
            table: [p.day for p in list_partitions(conn, table)]
            for table in ("samples", "feedback_events", "rewards")
        }
    expected = [date(2026, 3, 4) + timedelta(days=n) for n in range(4)]
    assert days == {"samples": expected, "feedback_events": expected, "rewards": expected}
    assert len(created) == 12
    assert again == []


def test_a_days_rows_move_from_the_default_partition_into_its_new_partition(
    history_engine: Engine, events: Events
) -> None:
    batch = served(events, 1, "u-1", DAY)
    store(history_engine, *batch, now=DAY + timedelta(hours=1))
    before = {table: table_rows(history_engine, table) for table in ("samples", "rewards")}
    assert partition_of(history_engine, "samples")("request_id", events.request(1)) == {
        "samples_default"
    }

    with history_engine.begin() as conn:
        create_partitions(conn, [DAY.date()])

    assert partition_of(history_engine, "samples")("request_id", events.request(1)) == {
        "samples_p20260304"
    }
    assert partition_of(history_engine, "feedback_events")("session_id", events.session(1)) == {
        "feedback_events_p20260304"
    }
    sample_id = before["samples"][0]["id"]
    assert partition_of(history_engine, "rewards")("sample_id", sample_id) == {"rewards_p20260304"}
    assert {table: table_rows(history_engine, table) for table in before} == before

    # Redelivered into the new partitions: still exactly one sample, event and reward each.
    store(history_engine, *batch, now=DAY + timedelta(hours=2))
    with history_engine.connect() as conn:
        counts = [
            conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one()
            for table in ("samples", "rewards", "feedback_events")
        ]
    assert counts == [1, 1, 4]
