"""`rtrl maintain` and `rtrl history import`: partitions ahead, retention to the archive, and
archived days read back into a database."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import Connection, Engine, Table, select, text
from sqlalchemy.dialects.postgresql import insert

from app.history.archive import ROW_GROUP, Archive, read_file, write_file
from app.history.erasure import ARCHIVE_LOCK, without_erased
from app.history.partitions import (
    PARTITION_KEYS,
    create_ahead,
    create_partitions,
    day_start,
    drop_partition,
    list_partitions,
    partition_name,
)
from app.models import Base, Checkpoint, CheckpointStatus

WRITE_ORDER = tuple(PARTITION_KEYS)
"""Samples before the rewards that reference them."""
DROP_ORDER = ("rewards", "feedback_events", "samples")


@dataclass
class Maintenance:
    """What one `rtrl maintain` did."""

    created: list[str] = field(default_factory=list)
    archived: dict[str, int] = field(default_factory=dict)
    """Rows exported per archived partition (or `<table>_default/<day>`)."""
    dropped: list[str] = field(default_factory=list)
    kept_for_training: list[date] = field(default_factory=list)
    """Days past the retention kept because the production checkpoint's samples are there."""
    files: list[str] = field(default_factory=list)


def history_table(name: str) -> Table:
    return Base.metadata.tables[name]


def training_floor(conn: Connection) -> datetime | None:
    """The oldest moment the trainer still reads: the production checkpoint's publication
    (its samples since then are its on-policy data, see `trainer.data`)."""
    production = conn.execute(
        select(Checkpoint.published_at, Checkpoint.created_at).where(
            Checkpoint.status == CheckpointStatus.production
        )
    ).first()
    if production is None:
        return None
    return production.published_at or production.created_at


def maintain(
    engine: Engine,
    archive_url: str,
    *,
    retention: timedelta | None,
    days_ahead: int,
    now: datetime | None = None,
) -> Maintenance:
    """Create partitions ahead; archive and drop the days older than `retention`.

    A day is dropped only when its whole span is older than the retention, and never while
    it holds samples the trainer may still read: a day ending after the production
    checkpoint's publication is kept, and reported, however old.
    """
    now = now or datetime.now(UTC)
    report = Maintenance()
    with engine.begin() as conn:
        report.created = create_ahead(conn, now.date(), days_ahead)
    if retention is None:
        return report
    cutoff = now - retention
    archive = Archive.at(archive_url)
    with engine.connect() as conn:
        floor = training_floor(conn)
        days = sorted(
            {p.day for table in PARTITION_KEYS for p in list_partitions(conn, table)}
            | set(_default_days(conn, cutoff))
        )
    for day in days:
        if day_start(day + timedelta(days=1)) > cutoff:
            continue
        if floor is not None and day_start(day + timedelta(days=1)) > floor:
            report.kept_for_training.append(day)
            continue
        with engine.begin() as conn:
            _archive_day(conn, archive, day, report)
    return report


def _default_days(conn: Connection, cutoff: datetime) -> Iterator[date]:
    """Days before `cutoff` with rows in a default partition (no day partition of their own)."""
    for table, key in PARTITION_KEYS.items():
        yield from conn.execute(
            text(
                f"SELECT DISTINCT (({key} AT TIME ZONE 'UTC')::date) FROM {table}_default "
                f"WHERE {key} < :cutoff"
            ),
            {"cutoff": cutoff},
        ).scalars()


def _archive_day(conn: Connection, archive: Archive, day: date, report: Maintenance) -> None:
    """Export one day of every table to the archive, then drop it (one transaction)."""
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ARCHIVE_LOCK)
    bounds = {"start": day_start(day), "end": day_start(day + timedelta(days=1))}
    present = {p.name for table in PARTITION_KEYS for p in list_partitions(conn, table)}
    for table_name in WRITE_ORDER:
        table = history_table(table_name)
        key = table.c[PARTITION_KEYS[table_name]]
        result = conn.execute(
            select(table)
            .where(key >= bounds["start"], key < bounds["end"])
            .execution_options(yield_per=ROW_GROUP)
        )
        path, rows = write_file(archive, table, day, result.partitions())
        if rows:
            report.files.append(path)
            report.archived[f"{table_name}/{day.isoformat()}"] = rows
        else:
            archive.fs.rm(path)
    # The rollups' ledger of counted rewards is never read again for these samples.
    conn.execute(
        text(
            "DELETE FROM rolled_up_rewards l USING samples s WHERE l.sample_id = s.id "
            "AND s.served_at >= :start AND s.served_at < :end"
        ),
        bounds,
    )
    for table_name in DROP_ORDER:
        name = partition_name(table_name, day)
        if name in present:
            drop_partition(conn, table_name, name)
            report.dropped.append(name)
        else:
            column = PARTITION_KEYS[table_name]
            conn.execute(
                text(
                    f"DELETE FROM {table_name}_default WHERE {column} >= :start AND {column} < :end"
                ),
                bounds,
            )


@dataclass
class Imported:
    """Rows read from the archive and rows new to the database, per table."""

    read: dict[str, int] = field(default_factory=dict)
    inserted: dict[str, int] = field(default_factory=dict)


def import_history(engine: Engine, archive_url: str) -> Imported:
    """Read every archived file back into the database (its schema already migrated).

    Rows already present are left as they are, so an import can be repeated or resumed;
    rows of users erased in this database are not brought back.
    """
    archive = Archive.at(archive_url)
    if not archive.fs.isdir(archive.root):
        raise FileNotFoundError(archive_url)
    report = Imported()
    for table_name in WRITE_ORDER:
        table = history_table(table_name)
        key = PARTITION_KEYS[table_name]
        report.read[table_name] = report.inserted[table_name] = 0
        for path in archive.files(table_name):
            for rows in read_file(archive, table, path):
                report.read[table_name] += len(rows)
                with engine.begin() as conn:
                    rows = _not_erased(conn, table_name, rows)
                    if not rows:
                        continue
                    create_partitions(conn, {row[key].astimezone(UTC).date() for row in rows})
                    statement = insert(table).on_conflict_do_nothing().returning(table.c[key])
                    report.inserted[table_name] += len(conn.execute(statement, rows).all())
    with engine.begin() as conn:
        for table_name in ("samples", "feedback_events"):
            conn.execute(
                text(
                    f"SELECT setval('{table_name}_id_seq', "
                    f"greatest((SELECT max(id) FROM {table_name}), 1))"
                )
            )
    return report


def _not_erased(
    conn: Connection, table_name: str, rows: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    if table_name == "samples":
        return without_erased(conn, rows, [])[0]
    if table_name == "feedback_events":
        return without_erased(conn, [], rows)[1]
    # A reward of an erased user's sample has no sample to reference: skipped below.
    ids = [row["sample_id"] for row in rows]
    present = set(
        conn.execute(
            text("SELECT id FROM samples WHERE id = ANY(CAST(:ids AS bigint[]))"), {"ids": ids}
        ).scalars()
    )
    return [row for row in rows if row["sample_id"] in present]
