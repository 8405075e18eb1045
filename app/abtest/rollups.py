"""The analytics rollups: samples and rewards summed once, so results read a few rows per user.

Aggregating a million raw samples (a wide table joined with its rewards) takes seconds; the
results endpoint has half a second. `refresh_rollups` therefore keeps running sums, and adds
to them only what changed since its last refresh: the samples written since (their requests,
errors, latency, ...) and, for every reward finalized or changed since, its new part minus
the part counted before (kept in `rolled_up_rewards`). Its cost follows the rate of new
data, not the size of the hour or the experiment, so results stay fast while samples pour in.

The sums are kept per unit the readers need:
- `experiment_users`: per experiment, arm and user over the whole experiment (with the
  user's first request in the arm): the unit of analysis (see `app.abtest.stats`);
- `experiment_user_days`: the same per UTC day, for results over a window of days;
- `user_days`: per user and day over all traffic, the pre-experiment values for CUPED;
- `hourly_rollups`: per checkpoint and hour, the trends;
- `experiment_latency` (2%-wide log buckets, the relative-error idea of DDSketch, Masson et
  al., VLDB 2019: a percentile read from them is within 1% of the exact one) and
  `experiment_latency_groups` (10%-wide buckets per group of users), per arm and day.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, Engine, text

from app.models.rollup import SUMMED

ROLLUP = "analytics"
BUCKET_GROWTH = 1.02
"""Consecutive latency buckets differ by this factor: 2% wide, at most 1% from any value."""
GROUP_BUCKET = 5
"""A user group's latency bucket spans this many 2% buckets (10% wide)."""
USER_GROUPS = 64
"""Users are hashed into this many groups for the clustered standard error of percentiles."""
IDLE_GRACE = timedelta(minutes=1)
"""A transaction that has written nothing yet and is older than this will not write rows."""
LONGEST_LOOKBACK = timedelta(hours=6)
"""A transaction open longer than this cannot hold the watermark back further."""
MAX_AGE = timedelta(seconds=30)
"""Results refresh the rollups first when they are older than this."""
REFRESH_LOCK = {"namespace": 0x7274726C, "key": -3}

DERIVED_TABLES = (
    "hourly_rollups",
    "experiment_users",
    "experiment_user_days",
    "user_days",
    "experiment_latency",
    "experiment_latency_groups",
    "rolled_up_rewards",
)

# Rows stamped (with their transaction's start) before this are committed: every
# transaction still open in this database started later, or is read-only and old (see
# IDLE_GRACE). Transactions in the server's other databases cannot write these tables.
_NEXT_WATERMARK = """
SELECT greatest(
    least(
        clock_timestamp(),
        (SELECT min(xact_start) FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
           AND datname = current_database()
           AND (backend_xid IS NOT NULL OR xact_start > clock_timestamp() - :idle_grace))
    ),
    clock_timestamp() - :lookback
)
"""

_BUCKET = f"floor(ln(greatest(s.latency_ms, 1.0)) / ln({BUCKET_GROWTH}))::int"
_USER_GROUP = f"(('x' || substr(md5(s.user_hash), 1, 7))::bit(28)::int % {USER_GROUPS})"

# One row per sample whose contribution changed: a new sample adds its request; a reward
# finalized or changed since adds its part now minus the part counted before.
_DELTA = f"""
CREATE TEMP TABLE rollup_delta ON COMMIT DROP AS
WITH touched AS (SELECT sample_id FROM rollup_touched),
now_counted AS (
    SELECT r.sample_id,
           (r.components->>'accepted')::boolean AS accepted,
           (r.components->>'dissatisfied')::boolean AS dissatisfied,
           coalesce((r.components->>'latency_over_budget')::boolean, false) AS over_budget,
           (r.components->>'kept')::float8 AS kept,
           r.reward
    FROM touched t JOIN rewards r ON r.sample_id = t.sample_id AND r.finalized_at IS NOT NULL
),
parts AS (
    SELECT s.id AS sample_id, s.served_at, s.checkpoint, s.experiment_id, s.arm, s.user_hash,
           (s.created_at >= :since)::int AS fresh, s.fallback, s.status, s.edit_requested,
           s.proposed_edit, s.tool_calls, s.malformed_tool_calls, s.latency_ms,
           {_BUCKET} AS bucket, {_USER_GROUP} AS user_group,
           c.sample_id IS NOT NULL AS now_final, c.accepted, c.dissatisfied, c.over_budget,
           c.kept, c.reward,
           l.sample_id IS NOT NULL AS was_final, l.accepted AS was_accepted,
           l.dissatisfied AS was_dissatisfied, l.over_budget AS was_over_budget,
           l.kept AS was_kept, l.reward AS was_reward
    FROM touched t
    JOIN samples s ON s.id = t.sample_id AND s.created_at < :until
    LEFT JOIN now_counted c ON c.sample_id = t.sample_id
    LEFT JOIN rolled_up_rewards l ON l.sample_id = t.sample_id
)
SELECT sample_id, served_at, checkpoint, experiment_id, arm, user_hash, fresh, bucket,
       user_group, now_final, accepted AS now_accepted, dissatisfied AS now_dissatisfied,
       over_budget AS now_over_budget, kept AS now_kept, reward AS now_reward,
       fresh AS requests,
       fresh * fallback::int AS fallback_requests,
       fresh * (status = 'error')::int AS errors,
       fresh * edit_requested::int AS edits_requested,
       fresh * (edit_requested AND proposed_edit)::int AS edits_proposed,
       fresh * (tool_calls > 0)::int AS tool_call_responses,
       fresh * (tool_calls > 0 AND malformed_tool_calls > 0)::int AS malformed_responses,
       fresh * latency_ms AS latency_sum,
       fresh * latency_ms ^ 2 AS latency_sumsq,
       now_final::int - was_final::int AS final_rewards,
       coalesce(over_budget::int, 0) - coalesce(was_over_budget::int, 0) AS over_budget,
       (accepted IS NOT NULL)::int - (was_accepted IS NOT NULL)::int AS accept_observed,
       coalesce(accepted::int, 0) - coalesce(was_accepted::int, 0) AS accepted,
       (dissatisfied IS NOT NULL)::int - (was_dissatisfied IS NOT NULL)::int
           AS dissatisfied_observed,
       coalesce(dissatisfied::int, 0) - coalesce(was_dissatisfied::int, 0) AS dissatisfied,
       (kept IS NOT NULL)::int - (was_kept IS NOT NULL)::int AS kept_n,
       coalesce(kept, 0) - coalesce(was_kept, 0) AS kept_sum,
       coalesce(kept ^ 2, 0) - coalesce(was_kept ^ 2, 0) AS kept_sumsq,
       (now_final AND proposed_edit)::int - (was_final AND proposed_edit)::int AS edits_final,
       (now_final AND proposed_edit AND kept IS NULL)::int
           - (was_final AND proposed_edit AND was_kept IS NULL)::int AS edits_censored,
       (reward IS NOT NULL)::int - (was_reward IS NOT NULL)::int AS reward_n,
       coalesce(reward, 0) - coalesce(was_reward, 0) AS reward_sum,
       coalesce(reward ^ 2, 0) - coalesce(was_reward ^ 2, 0) AS reward_sumsq
FROM parts
"""

# The samples a refresh touches, written to an indexed table and analysed before the delta
# reads them: as a CTE the planner guessed their number, and on a burst (216k touched) chose a
# nested loop that scanned the whole CTE once for each of its rows.
_TOUCHED_TABLE = (
    "CREATE TEMP TABLE rollup_touched (sample_id bigint PRIMARY KEY) ON COMMIT DROP",
    "INSERT INTO rollup_touched {touched}",
    "ANALYZE rollup_touched",
)
_TOUCHED = """
    SELECT id FROM samples WHERE created_at >= :since AND created_at < :until
    UNION
    SELECT sample_id FROM rewards WHERE updated_at >= :since AND updated_at < :until"""
# From scratch, every sample: the union with rewards would find nothing more.
_EVERY_SAMPLE = "SELECT id FROM samples WHERE created_at < :until"
DELTA = (*(s.format(touched=_TOUCHED) for s in _TOUCHED_TABLE), _DELTA)
REBUILD = (*(s.format(touched=_EVERY_SAMPLE) for s in _TOUCHED_TABLE), _DELTA)

_DAY = "(served_at AT TIME ZONE 'UTC')::date"
_IN_EXPERIMENT = "experiment_id IS NOT NULL AND arm IS NOT NULL"


def _add_sums(
    table: str, keys: dict[str, str], where: str = "TRUE", *, first_served: bool = False
) -> str:
    """Add the delta's sums, grouped by `keys` (column: expression), into `table`."""
    columns = [*keys, *SUMMED]
    selected = [f"{expression} AS {name}" for name, expression in keys.items()]
    selected += [f"sum({name})" for name in SUMMED]
    updates = [f"{name} = {table}.{name} + excluded.{name}" for name in SUMMED]
    if first_served:
        columns.append("first_served_at")
        selected.append("min(served_at)")
        updates.append(
            f"first_served_at = least({table}.first_served_at, excluded.first_served_at)"
        )
    return (
        f"INSERT INTO {table} ({', '.join(columns)}) SELECT {', '.join(selected)} "
        f"FROM rollup_delta WHERE {where} "
        f"GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))} "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}"
    )


def _add_counts(table: str, keys: dict[str, str]) -> str:
    """Add the new samples' request counts, grouped by `keys`, into a histogram `table`."""
    selected = ", ".join(f"{expression} AS {name}" for name, expression in keys.items())
    return (
        f"INSERT INTO {table} ({', '.join(keys)}, requests) SELECT {selected}, count(*) "
        f"FROM rollup_delta WHERE fresh = 1 AND {_IN_EXPERIMENT} "
        f"GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))} "
        f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET requests = {table}.requests + "
        "excluded.requests"
    )


_EXPERIMENT_KEYS = {"experiment_id": "experiment_id", "arm": "arm"}
APPLY_DELTA = (
    _add_sums(
        "hourly_rollups",
        {"hour": "date_trunc('hour', served_at, 'UTC')", "checkpoint": "checkpoint"},
    ),
    _add_sums(
        "experiment_users",
        {**_EXPERIMENT_KEYS, "user_hash": "user_hash"},
        _IN_EXPERIMENT,
        first_served=True,
    ),
    _add_sums(
        "experiment_user_days",
        {**_EXPERIMENT_KEYS, "day": _DAY, "user_hash": "user_hash"},
        _IN_EXPERIMENT,
    ),
    _add_sums("user_days", {"user_hash": "user_hash", "day": _DAY}),
    _add_counts("experiment_latency", {**_EXPERIMENT_KEYS, "day": _DAY, "bucket": "bucket"}),
    _add_counts(
        "experiment_latency_groups",
        {
            **_EXPERIMENT_KEYS,
            "day": _DAY,
            "user_group": "user_group",
            "bucket": f"floor(bucket::float8 / {GROUP_BUCKET})::int",
        },
    ),
    "DELETE FROM rolled_up_rewards l USING rollup_delta d WHERE l.sample_id = d.sample_id",
    "INSERT INTO rolled_up_rewards (sample_id, accepted, dissatisfied, over_budget, kept, reward) "
    "SELECT sample_id, now_accepted, now_dissatisfied, now_over_budget, now_kept, now_reward "
    "FROM rollup_delta WHERE now_final",
)


def refresh_rollups(bind: Engine | Connection) -> int | None:
    """Add what changed since the last refresh; the number of samples touched, None if busy.

    Safe to call from several processes at once (one refreshes, the others return None)
    and as often as wanted: a call with nothing new costs two index lookups.
    """
    if isinstance(bind, Engine):
        with bind.begin() as conn:
            return refresh_rollups(conn)
    conn = bind
    locked = conn.execute(
        text("SELECT pg_try_advisory_xact_lock(:namespace, :key)"), REFRESH_LOCK
    ).scalar_one()
    if not locked:
        return None
    conn.execute(text("SELECT pg_stat_clear_snapshot()"))
    until = conn.execute(
        text(_NEXT_WATERMARK), {"idle_grace": IDLE_GRACE, "lookback": LONGEST_LOOKBACK}
    ).scalar_one()
    since = conn.execute(
        text("SELECT watermark FROM rollup_state WHERE name = :name FOR UPDATE"), {"name": ROLLUP}
    ).scalar_one_or_none()
    conn.execute(text("DROP TABLE IF EXISTS pg_temp.rollup_delta, pg_temp.rollup_touched"))
    if since is None:
        conn.execute(text(f"TRUNCATE {', '.join(DERIVED_TABLES)}"))
        steps, since = REBUILD, datetime(1970, 1, 1, tzinfo=UTC)
    else:
        steps = DELTA
    for statement in steps:
        conn.execute(text(statement), {"since": since, "until": until})
    touched = conn.execute(text("SELECT count(*) FROM rollup_delta")).scalar_one()
    if touched:
        for statement in APPLY_DELTA:
            conn.execute(text(statement))
    conn.execute(text("DROP TABLE rollup_delta, rollup_touched"))
    conn.execute(
        text(
            "INSERT INTO rollup_state (name, watermark, refreshed_at) "
            "VALUES (:name, :watermark, now()) ON CONFLICT (name) DO UPDATE "
            "SET watermark = excluded.watermark, refreshed_at = excluded.refreshed_at"
        ),
        {"name": ROLLUP, "watermark": until},
    )
    return int(touched)


def rollup_age(conn: Connection) -> timedelta | None:
    """How long ago the rollups were refreshed; None if never."""
    refreshed_at = conn.execute(
        text("SELECT refreshed_at FROM rollup_state WHERE name = :name"), {"name": ROLLUP}
    ).scalar_one_or_none()
    return None if refreshed_at is None else datetime.now(UTC) - refreshed_at


def latency_quantile(histogram: Sequence[tuple[int, int]], fraction: float) -> float | None:
    """The `fraction` quantile of a latency histogram [(bucket, count)], bucket ascending.

    Within a bucket the mass is spread evenly on the log scale, so the value is interpolated
    geometrically between the bucket's edges.
    """
    total = sum(count for _, count in histogram)
    if total == 0:
        return None
    rank = fraction * total
    below = 0
    for bucket, count in histogram:
        if count and below + count >= rank:
            within = (rank - below) / count
            return float(BUCKET_GROWTH ** (bucket + within))
        below += count
    last_bucket = histogram[-1][0]
    return float(BUCKET_GROWTH ** (last_bucket + 1))


def bucket_of(latency_ms: float) -> int:
    """The histogram bucket of a latency, as the rollup SQL computes it."""
    return math.floor(math.log(max(latency_ms, 1.0)) / math.log(BUCKET_GROWTH))


# A user's counted part of every sum, negated: each sample created before the watermark
# counted its request; its reward counted what `rolled_up_rewards` holds.
_FORGET = f"""
CREATE TEMP TABLE rollup_delta ON COMMIT DROP AS
SELECT s.id AS sample_id, s.served_at, s.checkpoint, s.experiment_id, s.arm, s.user_hash,
       {_BUCKET} AS bucket, {_USER_GROUP} AS user_group,
       -1 AS requests,
       -(s.fallback::int) AS fallback_requests,
       -((s.status = 'error')::int) AS errors,
       -(s.edit_requested::int) AS edits_requested,
       -((s.edit_requested AND s.proposed_edit)::int) AS edits_proposed,
       -((s.tool_calls > 0)::int) AS tool_call_responses,
       -((s.tool_calls > 0 AND s.malformed_tool_calls > 0)::int) AS malformed_responses,
       -s.latency_ms AS latency_sum,
       -(s.latency_ms ^ 2) AS latency_sumsq,
       -((l.sample_id IS NOT NULL)::int) AS final_rewards,
       -coalesce(l.over_budget::int, 0) AS over_budget,
       -((l.accepted IS NOT NULL)::int) AS accept_observed,
       -coalesce(l.accepted::int, 0) AS accepted,
       -((l.dissatisfied IS NOT NULL)::int) AS dissatisfied_observed,
       -coalesce(l.dissatisfied::int, 0) AS dissatisfied,
       -((l.kept IS NOT NULL)::int) AS kept_n,
       -coalesce(l.kept, 0) AS kept_sum,
       -coalesce(l.kept ^ 2, 0) AS kept_sumsq,
       -((l.sample_id IS NOT NULL AND s.proposed_edit)::int) AS edits_final,
       -((l.sample_id IS NOT NULL AND s.proposed_edit AND l.kept IS NULL)::int) AS edits_censored,
       -((l.reward IS NOT NULL)::int) AS reward_n,
       -coalesce(l.reward, 0) AS reward_sum,
       -coalesce(l.reward ^ 2, 0) AS reward_sumsq
FROM samples s LEFT JOIN rolled_up_rewards l ON l.sample_id = s.id
WHERE s.user_hash = :user_hash AND s.created_at < :until
"""


def _subtract_counts(table: str, keys: dict[str, str]) -> str:
    """Take the delta's requests, grouped by `keys`, out of a histogram `table`."""
    selected = ", ".join(f"{expression} AS {name}" for name, expression in keys.items())
    matched = " AND ".join(f"{table}.{name} = d.{name}" for name in keys)
    return (
        f"UPDATE {table} SET requests = {table}.requests - d.n FROM (SELECT {selected}, "
        f"count(*) AS n FROM rollup_delta WHERE {_IN_EXPERIMENT} "
        f"GROUP BY {', '.join(str(i + 1) for i in range(len(keys)))}) d WHERE {matched}"
    )


FORGET_DELTA = (
    APPLY_DELTA[0],  # hourly_rollups: the delta's (negative) sums added
    _subtract_counts("experiment_latency", {**_EXPERIMENT_KEYS, "day": _DAY, "bucket": "bucket"}),
    _subtract_counts(
        "experiment_latency_groups",
        {
            **_EXPERIMENT_KEYS,
            "day": _DAY,
            "user_group": "user_group",
            "bucket": f"floor(bucket::float8 / {GROUP_BUCKET})::int",
        },
    ),
    "DELETE FROM rolled_up_rewards l USING rollup_delta d WHERE l.sample_id = d.sample_id",
    # An hour or bucket left with no request is one no sample ever reached.
    "DELETE FROM hourly_rollups WHERE requests = 0",
    "DELETE FROM experiment_latency WHERE requests = 0",
    "DELETE FROM experiment_latency_groups WHERE requests = 0",
)
USER_TABLES = ("experiment_users", "experiment_user_days", "user_days")


def forget_user(conn: Connection, user_hash: str) -> None:
    """Take a user out of the rollups before their samples are deleted: their rows in the
    per-user tables go, and what their samples still in Postgres added to the hourly trends
    and latency histograms is subtracted. Waits for a refresh in progress."""
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), REFRESH_LOCK)
    for table in USER_TABLES:
        conn.execute(
            text(f"DELETE FROM {table} WHERE user_hash = :user_hash"), {"user_hash": user_hash}
        )
    until = conn.execute(
        text("SELECT watermark FROM rollup_state WHERE name = :name"), {"name": ROLLUP}
    ).scalar_one_or_none()
    if until is None:
        return
    conn.execute(text("DROP TABLE IF EXISTS pg_temp.rollup_delta"))
    conn.execute(text(_FORGET), {"user_hash": user_hash, "until": until})
    for statement in FORGET_DELTA:
        conn.execute(text(statement))
    conn.execute(text("DROP TABLE rollup_delta"))
