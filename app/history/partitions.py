"""Daily partitions of the history tables: named, created ahead, listed.

`samples` and `rewards` are partitioned by the sample's `served_at`, `feedback_events` by the
event's own `occurred_at`: values that travel in the event, so every delivery of a row
lands in the same partition and its unique keys (which must include the partition key)
still make a redelivery a no-op. A default partition holds rows of days without one (an
IDE clock far off, a test's fixed date); creating that day's partition moves them out.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta

from sqlalchemy import Connection, text

PARTITION_KEYS = {"samples": "served_at", "feedback_events": "occurred_at", "rewards": "served_at"}
"""Each partitioned table and its partition key, in the order rows must be written (a reward
references its sample)."""

PARTITION_NAME = re.compile(r"^(samples|feedback_events|rewards)_(p\d{8}|default)$")
"""Names of the partitions themselves: migrations compare only their parents."""

LOCK = {"namespace": 0x7274726C, "key": -6}
"""One process changes partitions at a time."""


@dataclass(frozen=True)
class Partition:
    table: str
    name: str
    day: date


def partition_name(table: str, day: date) -> str:
    return f"{table}_p{day:%Y%m%d}"


def day_start(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def list_partitions(conn: Connection, table: str) -> list[Partition]:
    """The daily partitions of `table`, oldest first (the default partition is not listed)."""
    names = conn.execute(
        text(
            "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
            "WHERE i.inhparent = CAST(:table AS regclass)"
        ),
        {"table": table},
    ).scalars()
    found = []
    for name in names:
        match = PARTITION_NAME.match(name)
        if match and match.group(2) != "default":
            found.append(
                Partition(table, name, datetime.strptime(match.group(2), "p%Y%m%d").date())
            )
    return sorted(found, key=lambda partition: partition.day)


def create_partitions(conn: Connection, days: Iterable[date]) -> list[str]:
    """Make sure each history table has a partition for each of `days`; the names created.

    Rows already in a default partition for such a day move into the new partition, in the
    same transaction. Serialised by an advisory lock, so concurrent callers agree.
    """
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), LOCK)
    created = []
    for day in sorted(set(days)):
        missing = [
            table
            for table in PARTITION_KEYS
            if partition_name(table, day) not in {p.name for p in list_partitions(conn, table)}
        ]
        if missing:
            _create_day(conn, day, missing)
            created += [partition_name(table, day) for table in missing]
    return created


def create_ahead(conn: Connection, today: date, days_ahead: int) -> list[str]:
    """Partitions for today and the next `days_ahead` days; the names created."""
    return create_partitions(conn, (today + timedelta(days=n) for n in range(days_ahead + 1)))


def _create_day(conn: Connection, day: date, tables: list[str]) -> None:
    bounds = {"start": day_start(day), "end": day_start(day + timedelta(days=1))}
    # No writer may add a row of the day to a default partition between the check and the
    # new partition (Postgres would refuse the partition); they wait, briefly.
    defaults = ", ".join(f"{table}_default" for table in PARTITION_KEYS if table in tables)
    conn.execute(text(f"LOCK TABLE {defaults} IN SHARE ROW EXCLUSIVE MODE"))
    fill = {
        table: conn.execute(
            text(
                f"SELECT EXISTS (SELECT FROM {table}_default "
                f"WHERE {key} >= :start AND {key} < :end)"
            ),
            bounds,
        ).scalar_one()
        for table, key in PARTITION_KEYS.items()
        if table in tables
    }
    if not any(fill.values()):
        for table in tables:
            conn.execute(
                text(
                    f"CREATE TABLE {partition_name(table, day)} PARTITION OF {table} "
                    f"FOR VALUES FROM ('{bounds['start'].isoformat()}') "
                    f"TO ('{bounds['end'].isoformat()}')"
                )
            )
        return
    # Rows of the day wait in the default partitions: copy them into detached tables, delete
    # them there (rewards before their samples, so no cascade fires), then attach.
    for table in tables:
        key = PARTITION_KEYS[table]
        name = partition_name(table, day)
        conn.execute(
            text(f"CREATE TABLE {name} (LIKE {table} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
        )
        conn.execute(
            text(
                f"INSERT INTO {name} SELECT * FROM {table}_default "
                f"WHERE {key} >= :start AND {key} < :end"
            ),
            bounds,
        )
    for table in ("rewards", "feedback_events", "samples"):
        if table in tables:
            key = PARTITION_KEYS[table]
            conn.execute(
                text(f"DELETE FROM {table}_default WHERE {key} >= :start AND {key} < :end"), bounds
            )
    for table in PARTITION_KEYS:
        if table in tables:
            conn.execute(
                text(
                    f"ALTER TABLE {table} ATTACH PARTITION {partition_name(table, day)} "
                    f"FOR VALUES FROM ('{bounds['start'].isoformat()}') "
                    f"TO ('{bounds['end'].isoformat()}')"
                )
            )


def drop_partition(conn: Connection, table: str, name: str) -> None:
    """Detach and drop one partition (a referenced partition must be detached first)."""
    conn.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name}"))
    conn.execute(text(f"DROP TABLE {name}"))
