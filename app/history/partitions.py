"""Daily partitions of the history tables: named, created ahead, listed.

`samples` and `rewards` are partitioned by the sample's `served_at`, `feedback_events` by the
event's own `occurred_at`: values that travel in the event, so every delivery of a row
lands in the same partition and its unique keys (which must include the partition key)
still make a redelivery a no-op. A default partition holds rows of days without one (an
IDE clock far off, a test's fixed date); creating that day's partition moves them out.

Every change waits at most `LOCK_TIMEOUT_S` for a table's lock. A change waiting for its lock
holds up every insert into the table behind it (an export's open transaction can hold the
table for hours), so it gives up instead, tries again `LOCK_TRIES` times in all, and then
raises `PartitionsBusy`: the next `rtrl maintain` tries again, and rows of a day without a
partition wait in the default one meanwhile.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from functools import partial

from psycopg.errors import LockNotAvailable
from sqlalchemy import Connection, text
from sqlalchemy.exc import OperationalError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from app.processes import ServiceError

log = logging.getLogger(__name__)

PARTITION_KEYS = {"samples": "served_at", "feedback_events": "occurred_at", "rewards": "served_at"}
"""Each partitioned table and its partition key, in the order rows must be written (a reward
references its sample)."""

PARTITION_NAME = re.compile(r"^(samples|feedback_events|rewards)_(p\d{8}|default)$")
"""Names of the partitions themselves: migrations compare only their parents."""

LOCK = {"namespace": 0x7274726C, "key": -6}
"""One process changes partitions at a time."""
LOCK_TIMEOUT_S = 5.0
"""How long one try of a change waits for a table's lock (Postgres `lock_timeout`)."""
LOCK_TRIES = 4
"""Tries of a change, a pause (1 s, doubling) between them, before `PartitionsBusy`."""


class PartitionsBusy(ServiceError):
    """Other transactions held a table's lock through every try of a partition change."""


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


def create_partitions(
    conn: Connection,
    days: Iterable[date],
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    tries: int = LOCK_TRIES,
) -> list[str]:
    """Make sure each history table has a partition for each of `days`; the names created.

    Rows already in a default partition for such a day move into the new partition, in the
    same transaction. Serialised by an advisory lock, so concurrent callers agree. Raises
    `PartitionsBusy` when a day's tables stay locked through every try.
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
            _with_lock_timeout(
                conn,
                partial(_create_day, conn, day, missing),
                f"creating the partitions of {day}",
                lock_timeout_s=lock_timeout_s,
                tries=tries,
            )
            created += [partition_name(table, day) for table in missing]
    return created


def create_ahead(conn: Connection, today: date, days_ahead: int) -> list[str]:
    """Partitions for today and the next `days_ahead` days; the names created."""
    return create_partitions(conn, (today + timedelta(days=n) for n in range(days_ahead + 1)))


def _with_lock_timeout(
    conn: Connection,
    change: Callable[[], None],
    what: str,
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    tries: int = LOCK_TRIES,
) -> None:
    """Run `change` in a savepoint, waiting `lock_timeout_s` at most for each lock; `tries`
    times in all while a lock is not granted, then `PartitionsBusy`. The transaction's own
    `lock_timeout` is restored after."""

    def attempt() -> None:
        with conn.begin_nested():
            before = conn.execute(
                text(
                    "SELECT current_setting('lock_timeout'), set_config('lock_timeout', :ms, true)"
                ),
                {"ms": str(max(1, round(lock_timeout_s * 1000)))},
            ).scalar_one()
            change()
            conn.execute(
                text("SELECT set_config('lock_timeout', :before, true)"), {"before": before}
            )

    def waiting(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        log.warning(
            "%s: a table stayed locked for %g s (%s); trying again in %.0f s",
            what,
            lock_timeout_s,
            _cause(state.outcome.exception()),
            state.next_action.sleep,
        )

    retrying = Retrying(
        retry=retry_if_exception(_lock_not_granted),
        stop=stop_after_attempt(tries),
        wait=wait_exponential(multiplier=1, max=30),
        before_sleep=waiting,
        reraise=True,
    )
    try:
        retrying(attempt)
    except OperationalError as exc:
        if not _lock_not_granted(exc):
            raise
        raise PartitionsBusy(
            f"{what}: other transactions held a table's lock through {tries} tries of"
            f" {lock_timeout_s:g} s ({_cause(exc)}); nothing was changed. A long transaction"
            " in pg_stat_activity (an export, a session idle in a transaction) is the usual"
            " holder; the next `rtrl maintain` tries again"
        ) from None


def _lock_not_granted(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and isinstance(exc.orig, LockNotAvailable)


def _cause(exc: BaseException | None) -> str:
    cause = getattr(exc, "orig", exc)
    return str(cause).strip().splitlines()[0] if cause is not None else ""


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


def drop_partition(
    conn: Connection,
    table: str,
    name: str,
    *,
    lock_timeout_s: float = LOCK_TIMEOUT_S,
    tries: int = LOCK_TRIES,
) -> None:
    """Detach and drop one partition (a referenced partition must be detached first)."""

    def drop() -> None:
        conn.execute(text(f"ALTER TABLE {table} DETACH PARTITION {name}"))
        conn.execute(text(f"DROP TABLE {name}"))

    _with_lock_timeout(conn, drop, f"dropping {name}", lock_timeout_s=lock_timeout_s, tries=tries)
