"""The analytics rollups: hours of samples summed once, so results read hundreds of rows.

Aggregating a million raw samples (a wide table joined with its rewards, sorted for
percentiles and distinct users) takes seconds; the results endpoint has half a second.
`refresh_rollups` therefore rebuilds, per hour of `served_at`, the sums of every metric
(`hourly_rollups`), and records the users seen per arm (`experiment_users`) and per arm and
day (`experiment_user_days`, for windows), but only for the hours whose samples arrived or
whose rewards changed since the previous refresh.

Latency percentiles come from log-bucketed histograms (buckets 2% wide, the relative-error
idea of DDSketch, Masson et al., VLDB 2019), which add across hours; a percentile read from
them is within 1% of the exact one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import BindParameter, Connection, Engine, bindparam, text
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.types import DateTime

ROLLUP = "analytics"
BUCKET_GROWTH = 1.02
"""Consecutive latency buckets differ by this factor: 2% wide, at most 1% from any value."""
WRITER_MARGIN = timedelta(minutes=2)
"""Rows stamped this long before a refresh may still be uncommitted when it reads."""
LONGEST_LOOKBACK = timedelta(hours=6)
"""A transaction open longer than this cannot hold the watermark back further."""
MAX_AGE = timedelta(seconds=30)
"""Results refresh the rollups first when they are older than this."""
REFRESH_LOCK = {"namespace": 0x7274726C, "key": -3}

_HOUR = "date_trunc('hour', s.served_at, 'UTC')"

_REBUILD_HOURS = f"""
WITH by_bucket AS (
    SELECT {_HOUR} AS hour, s.checkpoint, s.experiment_id, s.arm,
           floor(ln(greatest(s.latency_ms, 1.0)) / ln({BUCKET_GROWTH}))::int AS bucket,
           count(*) AS requests,
           count(*) FILTER (WHERE s.fallback) AS fallback_requests,
           count(*) FILTER (WHERE s.status = 'error') AS errors,
           count(*) FILTER (WHERE s.edit_requested) AS edits_requested,
           count(*) FILTER (WHERE s.edit_requested AND s.proposed_edit) AS edits_proposed,
           count(*) FILTER (WHERE s.tool_calls > 0) AS tool_call_responses,
           count(*) FILTER (WHERE s.tool_calls > 0 AND s.malformed_tool_calls > 0)
               AS malformed_responses,
           count(r.sample_id) AS final_rewards,
           count(*) FILTER (WHERE (r.components->>'latency_over_budget')::boolean) AS over_budget,
           count((r.components->>'accepted')::boolean) AS accept_observed,
           count(*) FILTER (WHERE (r.components->>'accepted')::boolean) AS accepted,
           count((r.components->>'dissatisfied')::boolean) AS dissatisfied_observed,
           count(*) FILTER (WHERE (r.components->>'dissatisfied')::boolean) AS dissatisfied,
           count((r.components->>'kept')::float8) AS kept_n,
           coalesce(sum((r.components->>'kept')::float8), 0) AS kept_sum,
           coalesce(sum(((r.components->>'kept')::float8) ^ 2), 0) AS kept_sumsq,
           count(r.reward) AS reward_n,
           coalesce(sum(r.reward), 0) AS reward_sum,
           coalesce(sum(r.reward ^ 2), 0) AS reward_sumsq,
           sum(s.latency_ms) AS latency_sum,
           sum(s.latency_ms ^ 2) AS latency_sumsq
    FROM samples s
    LEFT JOIN rewards r ON r.sample_id = s.id AND r.finalized_at IS NOT NULL
    {{where}}
    GROUP BY 1, 2, 3, 4, 5
)
INSERT INTO hourly_rollups (
    hour, checkpoint, experiment_id, arm, requests, fallback_requests, errors,
    edits_requested, edits_proposed, tool_call_responses, malformed_responses, final_rewards,
    over_budget, accept_observed, accepted, dissatisfied_observed, dissatisfied,
    kept_n, kept_sum, kept_sumsq, reward_n, reward_sum, reward_sumsq,
    latency_sum, latency_sumsq, latency_buckets, latency_counts
)
SELECT hour, checkpoint, experiment_id, arm,
       sum(requests), sum(fallback_requests), sum(errors), sum(edits_requested),
       sum(edits_proposed), sum(tool_call_responses), sum(malformed_responses),
       sum(final_rewards), sum(over_budget), sum(accept_observed), sum(accepted),
       sum(dissatisfied_observed), sum(dissatisfied),
       sum(kept_n), sum(kept_sum), sum(kept_sumsq), sum(reward_n), sum(reward_sum),
       sum(reward_sumsq), sum(latency_sum), sum(latency_sumsq),
       array_agg(bucket ORDER BY bucket), array_agg(requests::int ORDER BY bucket)
FROM by_bucket
GROUP BY hour, checkpoint, experiment_id, arm
"""

_ADD_USER_DAYS = """
INSERT INTO experiment_user_days (experiment_id, arm, day, user_hash)
SELECT DISTINCT s.experiment_id, s.arm, (s.served_at AT TIME ZONE 'UTC')::date, s.user_hash
FROM samples s
WHERE s.experiment_id IS NOT NULL AND s.arm IS NOT NULL {where}
ON CONFLICT DO NOTHING
"""

_CHANGED_HOURS = f"""
SELECT {_HOUR} FROM samples s WHERE s.created_at >= :since
UNION
SELECT {_HOUR} FROM rewards r JOIN samples s ON s.id = r.sample_id WHERE r.updated_at >= :since
"""

# Rows stamped after this may not be visible yet: their transactions were still open.
_NEXT_WATERMARK = """
SELECT greatest(
    least(
        clock_timestamp() - :margin,
        (SELECT min(xact_start) FROM pg_stat_activity
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid())
    ),
    clock_timestamp() - :lookback
)
"""

# The hours to rebuild: a range the block-range index narrows, then the exact hours.
_IN_HOURS = f"""
    AND s.served_at >= :first_hour AND s.served_at < :last_hour + interval '1 hour'
    AND {_HOUR} = ANY(:hours)"""
_hours = bindparam("hours", type_=ARRAY(DateTime(timezone=True)))
_hour_params: list[BindParameter[Any]] = [
    _hours,
    bindparam("first_hour", type_=DateTime(timezone=True)),
    bindparam("last_hour", type_=DateTime(timezone=True)),
]
REBUILD_ALL = text(_REBUILD_HOURS.format(where=""))
REBUILD_HOURS = text(_REBUILD_HOURS.format(where="WHERE TRUE" + _IN_HOURS)).bindparams(
    *_hour_params
)
_ADD_USERS = """
INSERT INTO experiment_users (experiment_id, arm, user_hash)
SELECT DISTINCT s.experiment_id, s.arm, s.user_hash
FROM samples s
WHERE s.experiment_id IS NOT NULL AND s.arm IS NOT NULL {where}
ON CONFLICT DO NOTHING
"""
ADD_ALL_USER_DAYS = text(_ADD_USER_DAYS.format(where=""))
ADD_USER_DAYS = text(_ADD_USER_DAYS.format(where=_IN_HOURS)).bindparams(*_hour_params)
ADD_ALL_USERS = text(_ADD_USERS.format(where=""))
ADD_USERS = text(_ADD_USERS.format(where=_IN_HOURS)).bindparams(*_hour_params)
DELETE_HOURS = text("DELETE FROM hourly_rollups WHERE hour = ANY(:hours)").bindparams(_hours)


def refresh_rollups(bind: Engine | Connection) -> int | None:
    """Rebuild the hours changed since the last refresh; the number rebuilt, None if busy.

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
    next_watermark = conn.execute(
        text(_NEXT_WATERMARK), {"margin": WRITER_MARGIN, "lookback": LONGEST_LOOKBACK}
    ).scalar_one()
    watermark = conn.execute(
        text("SELECT watermark FROM rollup_state WHERE name = :name FOR UPDATE"), {"name": ROLLUP}
    ).scalar_one_or_none()
    if watermark is None:
        conn.execute(text("DELETE FROM hourly_rollups"))
        conn.execute(REBUILD_ALL)
        conn.execute(ADD_ALL_USER_DAYS)
        conn.execute(ADD_ALL_USERS)
        rebuilt = conn.execute(text("SELECT count(DISTINCT hour) FROM hourly_rollups")).scalar()
    else:
        hours = sorted(conn.execute(text(_CHANGED_HOURS), {"since": watermark}).scalars())
        if hours:
            in_hours = {"hours": hours, "first_hour": hours[0], "last_hour": hours[-1]}
            conn.execute(DELETE_HOURS, {"hours": hours})
            conn.execute(REBUILD_HOURS, in_hours)
            conn.execute(ADD_USER_DAYS, in_hours)
            conn.execute(ADD_USERS, in_hours)
        rebuilt = len(hours)
    conn.execute(
        text(
            "INSERT INTO rollup_state (name, watermark, refreshed_at) "
            "VALUES (:name, :watermark, now()) ON CONFLICT (name) DO UPDATE "
            "SET watermark = excluded.watermark, refreshed_at = excluded.refreshed_at"
        ),
        {"name": ROLLUP, "watermark": next_watermark},
    )
    return int(rebuilt or 0)


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
