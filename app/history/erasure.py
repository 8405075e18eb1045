"""Erasing a user: their samples, feedback and rewards, in Postgres and in the archive.

A user is erased as of a moment (`erased_users.erased_at`): what was served to them until
then is deleted and never stored again. Events still in Kafka are redelivered after an
erasure (a rebalance, a replay); `without_erased` makes the workers skip them, and records
each skipped completion's session so its feedback, which names no user, is skipped too.

Writers of history hold `hold_off_erasure` (a shared lock) for their transaction; the
erasure takes it exclusively, so a batch either commits before the erasure deletes (and
its rows are deleted) or starts after it commits (and sees the user erased).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import anyio
import pyarrow as pa
import pyarrow.compute as pc
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncSession

from app.abtest.rollups import forget_user
from app.history.archive import Archive, rewrite_without

ERASURE_LOCK = {"namespace": 0x7274726C, "key": -7}
"""Shared by every writer of history, exclusive for an erasure."""
ARCHIVE_LOCK = {"namespace": 0x7274726C, "key": -8}
"""Held by an erasure from its first read to its commit, and by retention while it archives a
day: a day archived in between would escape the erasure."""


@dataclass
class UserHistory:
    """What identifies a user's rows: samples, and the requests and sessions feedback names."""

    sample_ids: set[int] = field(default_factory=set)
    request_ids: set[str] = field(default_factory=set)
    session_ids: set[str] = field(default_factory=set)

    def add(self, other: UserHistory) -> None:
        self.sample_ids |= other.sample_ids
        self.request_ids |= other.request_ids
        self.session_ids |= other.session_ids


@dataclass(frozen=True)
class Erased:
    """How many rows an erasure removed, in Postgres and in the archive."""

    samples: int
    feedback_events: int
    rewards: int
    archived_samples: int
    archived_feedback_events: int
    archived_rewards: int
    archive_files_rewritten: int


def hold_off_erasure(conn: Connection) -> None:
    """Keep an erasure from running between this transaction's check and its commit."""
    conn.execute(text("SELECT pg_advisory_xact_lock_shared(:namespace, :key)"), ERASURE_LOCK)


def user_history(conn: Connection, user_hash: str) -> UserHistory:
    """The user's samples in Postgres (through `ix_samples_user_hash`, every partition)."""
    history = UserHistory()
    for row in conn.execute(
        text("SELECT id, request_id, session_id FROM samples WHERE user_hash = :user_hash"),
        {"user_hash": user_hash},
    ):
        history.sample_ids.add(row.id)
        history.request_ids.add(row.request_id)
        history.session_ids.add(row.session_id)
    return history


def start_erasure(conn: Connection, user_hash: str) -> UserHistory:
    """Hold off retention for this transaction, and read what the user has in Postgres."""
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ARCHIVE_LOCK)
    return user_history(conn, user_hash)


def erase_from_archive(
    archive: Archive, user_hash: str, known: UserHistory
) -> tuple[UserHistory, dict[str, int], int]:
    """Rewrite every archived file holding the user's rows without them.

    Returns what the archive held of the user (so Postgres can drop feedback whose sample was
    archived), rows removed per table, and files rewritten.
    """
    found = UserHistory()
    removed = {"samples": 0, "feedback_events": 0, "rewards": 0}
    rewritten = 0
    for path in archive.files("samples"):
        dropped = rewrite_without(
            archive, path, ["user_hash"], lambda rows: pc.equal(rows["user_hash"], user_hash)
        )
        if dropped is not None:
            found.sample_ids.update(dropped["id"].to_pylist())
            found.request_ids.update(dropped["request_id"].to_pylist())
            found.session_ids.update(dropped["session_id"].to_pylist())
            removed["samples"] += dropped.num_rows
            rewritten += 1
    every = UserHistory()
    every.add(known)
    every.add(found)
    sample_ids = pa.array(sorted(every.sample_ids), type=pa.int64())
    request_ids = pa.array(sorted(every.request_ids), type=pa.string())
    session_ids = pa.array(sorted(every.session_ids), type=pa.string())
    for path in archive.files("rewards"):
        dropped = rewrite_without(
            archive,
            path,
            ["sample_id"],
            lambda rows: pc.is_in(rows["sample_id"], value_set=sample_ids),
        )
        if dropped is not None:
            removed["rewards"] += dropped.num_rows
            rewritten += 1
    for path in archive.files("feedback_events"):
        dropped = rewrite_without(
            archive,
            path,
            ["request_id", "session_id"],
            lambda rows: pc.or_(
                pc.is_in(rows["request_id"], value_set=request_ids),
                pc.is_in(rows["session_id"], value_set=session_ids),
            ),
        )
        if dropped is not None:
            removed["feedback_events"] += dropped.num_rows
            rewritten += 1
    return found, removed, rewritten


def erase_in_database(
    conn: Connection, user_hash: str, known: UserHistory, *, now: datetime
) -> dict[str, int]:
    """Record the erasure and delete the user's rows; the rollups lose their part first.

    Waits for in-flight worker batches (see `hold_off_erasure`), so nothing of the user
    committed before this point survives and nothing after it is stored.
    """
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ERASURE_LOCK)
    conn.execute(
        text(
            "INSERT INTO erased_users (user_hash, erased_at) VALUES (:user_hash, :now) "
            "ON CONFLICT (user_hash) DO UPDATE SET erased_at = excluded.erased_at"
        ),
        {"user_hash": user_hash, "now": now},
    )
    history = user_history(conn, user_hash)
    history.add(known)
    if history.session_ids:
        conn.execute(
            text(
                "INSERT INTO erased_sessions (session_id, user_hash, erased_at) "
                "SELECT unnest(CAST(:sids AS text[])), :user_hash, :now "
                "ON CONFLICT (session_id) DO NOTHING"
            ),
            {"sids": sorted(history.session_ids), "user_hash": user_hash, "now": now},
        )
    forget_user(conn, user_hash)
    feedback = conn.execute(
        text(
            "DELETE FROM feedback_events WHERE request_id = ANY(CAST(:rids AS text[])) "
            "OR session_id = ANY(CAST(:sids AS text[]))"
        ),
        {"rids": sorted(history.request_ids), "sids": sorted(history.session_ids)},
    ).rowcount
    rewards = conn.execute(
        text("DELETE FROM rewards WHERE sample_id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": sorted(history.sample_ids)},
    ).rowcount
    conn.execute(
        text("DELETE FROM rolled_up_rewards WHERE sample_id = ANY(CAST(:ids AS bigint[]))"),
        {"ids": sorted(history.sample_ids)},
    )
    samples = conn.execute(
        text("DELETE FROM samples WHERE user_hash = :user_hash"), {"user_hash": user_hash}
    ).rowcount
    return {"samples": samples, "feedback_events": feedback, "rewards": rewards}


def without_erased(
    conn: Connection,
    sample_rows: Sequence[dict[str, Any]],
    feedback_rows: Sequence[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rows still to store: none served to an erased user before their erasure, none in
    a session of theirs. A completion skipped here erases its session too, with any of its
    feedback that arrived first."""
    hashes = sorted({row["user_hash"] for row in sample_rows})
    sessions = sorted({row["session_id"] for row in [*sample_rows, *feedback_rows]})
    erased_at: dict[str, datetime] = {}
    if hashes:
        erased_at = {
            row.user_hash: row.erased_at
            for row in conn.execute(
                text(
                    "SELECT user_hash, erased_at FROM erased_users "
                    "WHERE user_hash = ANY(CAST(:hashes AS text[]))"
                ),
                {"hashes": hashes},
            )
        }
    erased_sessions: set[str] = set()
    if sessions:
        erased_sessions = set(
            conn.execute(
                text(
                    "SELECT session_id FROM erased_sessions "
                    "WHERE session_id = ANY(CAST(:sids AS text[]))"
                ),
                {"sids": sessions},
            ).scalars()
        )
    if not erased_at and not erased_sessions:
        return list(sample_rows), list(feedback_rows)
    kept_samples = []
    newly_erased: dict[str, tuple[str, datetime]] = {}
    for row in sample_rows:
        erased = erased_at.get(row["user_hash"])
        if row["session_id"] in erased_sessions:
            continue
        if erased is not None and row["served_at"] <= erased:
            newly_erased[row["session_id"]] = (row["user_hash"], erased)
            continue
        kept_samples.append(row)
    if newly_erased:
        conn.execute(
            text(
                "INSERT INTO erased_sessions (session_id, user_hash, erased_at) "
                "SELECT * FROM unnest(CAST(:sids AS text[]), CAST(:hashes AS text[]), "
                "CAST(:ats AS timestamptz[])) ON CONFLICT (session_id) DO NOTHING"
            ),
            {
                "sids": list(newly_erased),
                "hashes": [user for user, _ in newly_erased.values()],
                "ats": [at for _, at in newly_erased.values()],
            },
        )
        conn.execute(
            text("DELETE FROM feedback_events WHERE session_id = ANY(CAST(:sids AS text[]))"),
            {"sids": list(newly_erased)},
        )
        erased_sessions |= set(newly_erased)
    kept_feedback = [row for row in feedback_rows if row["session_id"] not in erased_sessions]
    return kept_samples, kept_feedback


async def erase_user(
    session: AsyncSession, archive: Archive, user_hash: str, *, now: datetime
) -> Erased:
    """Erase a user everywhere, in the session's transaction: Postgres is read, the archive
    rewritten (in a worker thread), then Postgres deleted; nothing is deleted from
    Postgres unless the archive was rewritten. Retention waits until the session commits."""
    known = await session.run_sync(lambda sync: start_erasure(sync.connection(), user_hash))
    found, archived, rewritten = await anyio.to_thread.run_sync(
        erase_from_archive, archive, user_hash, known
    )
    known.add(found)
    deleted = await session.run_sync(
        lambda sync: erase_in_database(sync.connection(), user_hash, known, now=now)
    )
    return Erased(
        samples=deleted["samples"],
        feedback_events=deleted["feedback_events"],
        rewards=deleted["rewards"],
        archived_samples=archived["samples"],
        archived_feedback_events=archived["feedback_events"],
        archived_rewards=archived["rewards"],
        archive_files_rewritten=rewritten,
    )
