"""The worker's SQL: bulk idempotent writes, the reads distillation needs, row checks."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import orjson
import psycopg
from psycopg import postgres
from psycopg.adapt import Dumper
from sqlalchemy import (
    ARRAY,
    BigInteger,
    ColumnElement,
    Connection,
    Engine,
    Float,
    Integer,
    Row,
    String,
    Table,
    Text,
    and_,
    bindparam,
    case,
    cast,
    func,
    null,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import JSONB, Insert, insert

from app.db import make_engine
from app.models import Base, FeedbackEventRow, Reward, Sample
from app.signals.rewards import Signal

samples = Base.metadata.tables[Sample.__tablename__]
feedback_events = Base.metadata.tables[FeedbackEventRow.__tablename__]
rewards = Base.metadata.tables[Reward.__tablename__]

# What distillation reads of a sample: metrics only, never the token ids or text.
SAMPLE_METRIC_COLUMNS: tuple[ColumnElement[Any], ...] = (
    samples.c.id,
    samples.c.request_id,
    samples.c.session_id,
    samples.c.served_at,
    samples.c.served_at.label("occurred_at"),  # read as the completion's (`Served`)
    samples.c.checkpoint,
    samples.c.user_hash,
    samples.c.api_key_id,
    samples.c.edit_requested,
    samples.c.proposed_edit,
    samples.c.status,
    samples.c.ttft_ms,
    samples.c.ttft_measured,
    samples.c.latency_ms,
    samples.c.completion_tokens,
    samples.c.trajectory_id,
    samples.c.tool_calls,
    samples.c.malformed_tool_calls,
    samples.c.clarifying_question,
)

# What distillation reads of a feedback event: the signal, never the follow-up's text (its
# verdict, stored at ingest, stands in for it). In the order of `Signal`'s fields, so that a
# row becomes a signal as `Signal(*row)`.
FEEDBACK_SIGNAL_COLUMNS: tuple[ColumnElement[Any], ...] = (
    feedback_events.c.kind,
    feedback_events.c.event_id,
    feedback_events.c.request_id,
    feedback_events.c.session_id,
    feedback_events.c.occurred_at,
    feedback_events.c.elapsed_s,
    feedback_events.c.surviving_share,
    and_(
        feedback_events.c.kind == "edit_survival", feedback_events.c.surviving_share.is_(None)
    ).label("censored"),
    null().label("message"),
    feedback_events.c.dissatisfied,
    feedback_events.c.api_key_id,
    feedback_events.c.received_at,
)
assert [column.name for column in FEEDBACK_SIGNAL_COLUMNS] == [
    field.name for field in dataclasses.fields(Signal)
]

# Lock namespace for pg_advisory_xact_lock(namespace, partition); see `lock_partitions`.
PARTITION_LOCK_NAMESPACE = 0x7274726C  # "rtrl"

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def make_worker_engine(database_url: str) -> Engine:
    """An engine whose JSONB columns go through orjson and whose errors never show row data."""
    return make_engine(
        database_url,
        hide_parameters=True,
        json_serializer=lambda value: orjson.dumps(value).decode(),
        json_deserializer=orjson.loads,
    )


# --- checks before writing ----------------------------------------------------------------


def unstorable(table: Table, row: dict[str, Any]) -> str | None:
    """Why Postgres would reject `row` (NUL in text, too long, out of range), or None.

    Scalar floats must also be finite: they end up in JSON components, which have no inf.
    """
    for name, rule, limit in _column_rules(table):
        value = row.get(name)
        if value is None:
            continue
        if rule == "text":
            if "\x00" in value:
                return f"{name} contains a NUL character"
            if limit and len(value) > limit:
                return f"{name} is longer than {limit} characters"
        elif rule == "int4":
            if not INT32_MIN <= value <= INT32_MAX:
                return f"{name} is out of the integer range"
        elif rule == "float":
            if not math.isfinite(value):
                return f"{name} is not a finite number"
        elif rule == "int4[]":
            if value and (min(value) < INT32_MIN or max(value) > INT32_MAX):
                return f"{name} holds a value out of the integer range"
        elif rule == "json" and b"\\u0000" in orjson.dumps(value):
            return f"{name} contains a NUL character"
    return None


@functools.cache
def _column_rules(table: Table) -> list[tuple[str, str, int]]:
    rules = []
    for column in table.c:
        column_type = column.type
        if isinstance(column_type, String):
            rules.append((column.name, "text", column_type.length or 0))
        elif isinstance(column_type, Integer) and not isinstance(column_type, BigInteger):
            rules.append((column.name, "int4", 0))
        elif isinstance(column_type, Float):
            rules.append((column.name, "float", 0))
        elif isinstance(column_type, ARRAY) and type(column_type.item_type) is Integer:
            rules.append((column.name, "int4[]", 0))
        elif isinstance(column_type, JSONB):
            rules.append((column.name, "json", 0))
    return rules


# --- bulk writes --------------------------------------------------------------------------


def bulk_insert(table: Table, columns: tuple[str, ...]) -> Insert:
    """`INSERT INTO table (columns) SELECT * FROM unnest(:column, ...)`: one array per column.

    One statement per batch, however many rows: executemany sent one INSERT per row and
    spent more time in SQLAlchemy and psycopg than Postgres spent storing the rows. Every
    value travels as text (see `as_columns`) and Postgres parses it into its column's type.
    """
    arrays = [cast(bindparam(name), ARRAY(Text)) for name in columns]
    unnested = func.unnest(*arrays).table_valued(*columns).render_derived()
    values = [cast(unnested.c[name], table.c[name].type) for name in columns]
    return insert(table).from_select(list(columns), select(*values))


def as_columns(table: Table, rows: Sequence[dict[str, Any]]) -> dict[str, TextArray]:
    """Rows as one text array per column, the parameters of `bulk_insert`."""
    columns = {}
    for name in rows[0]:
        column_type = table.c[name].type
        if isinstance(column_type, ARRAY):
            columns[name] = TextArray(array_literal(row[name]) for row in rows)
        elif isinstance(column_type, JSONB):
            columns[name] = TextArray(
                None if row[name] is None else orjson.dumps(row[name]).decode() for row in rows
            )
        else:
            columns[name] = text_array(row[name] for row in rows)
    return columns


def text_array(values: Iterable[Any]) -> TextArray:
    """Values as the text Postgres reads them from: str() of a float round-trips exactly."""
    return TextArray(None if value is None else str(value) for value in values)


def array_literal(values: Sequence[float] | None) -> str | None:
    """A list as its Postgres array literal: `[1, 2]` → `{1,2}`."""
    if values is None:
        return None
    items = orjson.dumps(values).decode()[1:-1]
    if "null" in items:  # orjson writes NaN and ±inf as null; Postgres reads them by name
        items = ",".join(map(repr, values))
    return "{" + items + "}"


class TextArray(list[str | None]):
    """Strings bound as one `text[]` parameter by `TextArrayDumper`."""


class TextArrayDumper(Dumper):
    """Dumps a `TextArray` as a quoted array literal."""

    # psycopg's own list dumper runs a regex substitution per element needing quotes, which
    # took a third of a batch's time on the JSON of the reward components.
    oid = postgres.types["text"].array_oid

    def dump(self, obj: TextArray) -> bytes:
        return (
            "{"
            + ",".join(
                "NULL" if s is None else '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
                for s in obj
            )
            + "}"
        ).encode()


psycopg.adapters.register_dumper(TextArray, TextArrayDumper)


@functools.cache
def _insert_new(table: Table, columns: tuple[str, ...]) -> Insert:
    return bulk_insert(table, columns).on_conflict_do_nothing()


@functools.cache
def _upsert_open_rewards(columns: tuple[str, ...]) -> Insert:
    statement = bulk_insert(rewards, columns)
    return statement.on_conflict_do_update(
        index_elements=[rewards.c.sample_id, rewards.c.served_at],
        set_={name: statement.excluded[name] for name in columns if name != "sample_id"}
        | {"updated_at": func.now()},
        where=rewards.c.finalized_at.is_(None),
    )


def insert_samples(conn: Connection, rows: Sequence[dict[str, Any]]) -> set[str]:
    """Insert samples; one already stored (same event id or request id) is left as it is.

    Returns the request ids of the samples that are new.
    """
    if not rows:
        return set()
    statement = _insert_new(samples, tuple(rows[0])).returning(samples.c.request_id)
    return set(conn.execute(statement, as_columns(samples, rows)).scalars())


def insert_feedback(conn: Connection, rows: Sequence[dict[str, Any]]) -> list[Row[Any]]:
    """Insert feedback events; one already stored (same event id) is left as it is.

    Returns the request id, session id and kind of each event that is new: a redelivered
    event is evidence already applied.
    """
    if not rows:
        return []
    statement = _insert_new(feedback_events, tuple(rows[0])).returning(
        feedback_events.c.request_id, feedback_events.c.session_id, feedback_events.c.kind
    )
    return list(conn.execute(statement, as_columns(feedback_events, rows)))


def upsert_rewards(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert or update open rewards; a finalized reward is left as it is."""
    if rows:
        # In sample-id order, so concurrent upserts lock rows in the same order.
        ordered = sorted(rows, key=lambda row: row["sample_id"])
        conn.execute(_upsert_open_rewards(tuple(ordered[0])), as_columns(rewards, ordered))


def scrub_private_followups(conn: Connection, session_ids: Collection[str]) -> None:
    """Drop follow-up text in privacy sessions, keeping the verdict; it may predate the sample."""
    if not session_ids:
        return
    has_private_sample = (
        select(samples.c.id)
        .where(samples.c.session_id == feedback_events.c.session_id, samples.c.privacy)
        .exists()
    )
    conn.execute(
        update(feedback_events)
        .where(
            feedback_events.c.session_id == _any("sids", String),
            feedback_events.c.message.is_not(None),
            has_private_sample,
        )
        .values(message=None),
        {"sids": text_array(session_ids)},
    )


def lock_partitions(conn: Connection, partitions: Iterable[int]) -> None:
    """Serialise transactions that write events of the same Kafka partition number.

    A session's completions and feedback share a key, so they land on the same partition
    number of both topics; the range assignor gives both to one worker, and this lock keeps
    a stale owner (after a rebalance) from racing the new one into a reward that misses
    the other's rows. Taken in order, so two workers never deadlock.
    """
    for partition in sorted(set(partitions)):
        conn.execute(
            text("SELECT pg_advisory_xact_lock(:namespace, :partition)"),
            {"namespace": PARTITION_LOCK_NAMESPACE, "partition": partition},
        )


# --- reads for distillation ---------------------------------------------------------------


def _any(name: str, item_type: type[String] | type[BigInteger]) -> ColumnElement[Any]:
    """`= ANY(:name)` with one array parameter (a `text_array`), however many values."""
    return func.any(cast(bindparam(name), ARRAY(item_type)))


def load_open_samples(
    conn: Connection,
    *,
    request_ids: Collection[str] = (),
    ended_sessions: Collection[str] = (),
    sample_ids: Collection[int] = (),
) -> list[Row[Any]]:
    """Samples named by request, by an ended session or by id whose reward is not final."""
    query = (
        select(*SAMPLE_METRIC_COLUMNS)
        .select_from(samples.outerjoin(rewards, rewards.c.sample_id == samples.c.id))
        .where(
            or_(
                samples.c.request_id == _any("rids", String),
                samples.c.session_id == _any("sids", String),
                samples.c.id == _any("ids", BigInteger),
            ),
            rewards.c.finalized_at.is_(None),
        )
        .order_by(samples.c.id)
    )
    params = {
        "rids": text_array(request_ids),
        "sids": text_array(ended_sessions),
        "ids": text_array(sample_ids),
    }
    return list(conn.execute(query, params).all())


def load_touched_samples(
    conn: Connection, *, request_ids: Collection[str], ended_sessions: Collection[str]
) -> list[Row[Any]]:
    """The samples of these requests (their reward open or final), and the open ones of these
    ended sessions, each with its reward's state (`finalized_at` None while open)."""
    query = (
        select(
            *SAMPLE_METRIC_COLUMNS,
            rewards.c.components,
            rewards.c.finalized_at,
            rewards.c.finalize_reason,
            rewards.c.due_at,
            rewards.c.reward_version,
        )
        .select_from(samples.outerjoin(rewards, rewards.c.sample_id == samples.c.id))
        .where(
            or_(
                samples.c.request_id == _any("rids", String),
                and_(
                    samples.c.session_id == _any("sids", String),
                    rewards.c.finalized_at.is_(None),
                ),
            )
        )
        .order_by(samples.c.id)
    )
    params = {"rids": text_array(request_ids), "sids": text_array(ended_sessions)}
    found: list[Row[Any]] = [*conn.execute(query, params)]
    return found


def reopen_rewards(conn: Connection, rows: Sequence[dict[str, Any]]) -> None:
    """Apply late evidence to final rewards: their new state, and one more reopen counted."""
    if not rows:
        return
    conn.execute(
        update(rewards)
        .where(
            rewards.c.sample_id == bindparam("b_sample_id"),
            rewards.c.served_at == bindparam("b_served_at"),
        )
        .values(
            components=bindparam("b_components"),
            reward=bindparam("b_reward"),
            reward_version=bindparam("b_reward_version"),
            due_at=bindparam("b_due_at"),
            finalized_at=bindparam("b_finalized_at"),
            finalize_reason=bindparam("b_finalize_reason"),
            reopen_count=rewards.c.reopen_count + 1,
            updated_at=func.now(),
        ),
        [{f"b_{name}": value for name, value in row.items()} for row in rows],
    )


def load_runs(conn: Connection, trajectory_ids: Collection[str]) -> list[Row[Any]]:
    """Every turn of these agent runs with its reward, in turn order."""
    if not trajectory_ids:
        return []
    query = (
        select(
            samples.c.trajectory_id,
            samples.c.turn_index,
            rewards.c.sample_id,
            rewards.c.components,
            rewards.c.reward,
            rewards.c.finalized_at,
        )
        .select_from(samples.join(rewards, rewards.c.sample_id == samples.c.id))
        .where(samples.c.trajectory_id == _any("tids", String))
        .order_by(samples.c.trajectory_id, samples.c.turn_index, samples.c.id)
    )
    found: list[Row[Any]] = [*conn.execute(query, {"tids": text_array(trajectory_ids)})]
    return found


def set_rewards(conn: Connection, values: Mapping[int, float | None], version: int) -> None:
    """Set the reward of final records (an agent run's credit moved)."""
    if values:
        conn.execute(
            update(rewards)
            .where(rewards.c.sample_id == bindparam("b_sample_id"))
            .values(reward=bindparam("b_reward"), reward_version=version, updated_at=func.now()),
            [{"b_sample_id": sample_id, "b_reward": value} for sample_id, value in values.items()],
        )


def count_late_evidence(conn: Connection, sample_ids: Collection[int]) -> None:
    """Count evidence that came after the reopen window on its (unchanged) reward."""
    if sample_ids:
        conn.execute(
            update(rewards)
            .where(rewards.c.sample_id == _any("ids", BigInteger))
            .values(late_evidence_count=rewards.c.late_evidence_count + 1),
            {"ids": text_array(sample_ids)},
        )


FEEDBACK_ROWS_PER_KIND = 64
"""Most events of one kind read for one request (and `session_end` events for one session and
key): the first received. The gateway accepts far fewer (`RTRL_FEEDBACK_*` limits), so this
only bounds what a request id flooded past those limits costs every batch that touches it."""


def load_feedback_signals(
    conn: Connection, request_ids: Collection[str], session_ids: Collection[str]
) -> list[Row[Any]]:
    """The feedback of these requests, and the `session_end` events of these sessions: of each
    kind, the first `FEEDBACK_ROWS_PER_KIND` received."""
    is_end = feedback_events.c.kind == "session_end"
    nth = (
        func.row_number()
        .over(
            partition_by=(
                feedback_events.c.kind,
                case((is_end, feedback_events.c.session_id), else_=feedback_events.c.request_id),
                feedback_events.c.api_key_id,
            ),
            order_by=(feedback_events.c.received_at, feedback_events.c.event_id),
        )
        .label("nth")
    )
    found = (
        select(*FEEDBACK_SIGNAL_COLUMNS, nth)
        .where(
            or_(
                feedback_events.c.request_id == _any("rids", String),
                and_(is_end, feedback_events.c.session_id == _any("sids", String)),
            )
        )
        .subquery()
    )
    query = select(*(found.c[column.name] for column in FEEDBACK_SIGNAL_COLUMNS)).where(
        found.c.nth <= FEEDBACK_ROWS_PER_KIND
    )
    params = {"rids": text_array(request_ids), "sids": text_array(session_ids)}
    return list(conn.execute(query, params).all())
