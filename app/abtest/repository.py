"""The analytics reads: per-arm sums, histograms and users from the rollups; raw exports."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any, Literal

from sqlalchemy import Boolean, ColumnElement, Float, Row, Select, and_, cast, func, select, true
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from app.models import ExperimentUser, ExperimentUserDay, HourlyRollup, Reward, Sample

Bucket = Literal["hour", "day"]

rollups = HourlyRollup.__table__
user_days = ExperimentUserDay.__table__
experiment_users = ExperimentUser.__table__
samples = Sample.__table__
rewards = Reward.__table__

PROPORTIONS: dict[str, tuple[str, str]] = {
    # name: (rollup column of successes, rollup column of observations)
    "acceptance_rate": ("accepted", "accept_observed"),
    "dissatisfied_rate": ("dissatisfied", "dissatisfied_observed"),
    "malformed_call_rate": ("malformed_responses", "tool_call_responses"),
    "edit_rate": ("edits_proposed", "edits_requested"),
    "error_rate": ("errors", "requests"),
    "latency_over_budget_rate": ("over_budget", "final_rewards"),
}
MEANS: dict[str, tuple[str, str, str]] = {
    # name: (rollup columns of count, sum, sum of squares)
    "kept": ("kept_n", "kept_sum", "kept_sumsq"),
    "mean_reward": ("reward_n", "reward_sum", "reward_sumsq"),
    "latency_mean_ms": ("requests", "latency_sum", "latency_sumsq"),
}
_SUMMED = sorted(
    {"requests", "fallback_requests"}
    | {column for pair in PROPORTIONS.values() for column in pair}
    | {column for triple in MEANS.values() for column in triple}
)


@dataclass(frozen=True)
class ArmSummary:
    """Everything the statistics need about one arm, summed over the window's hours."""

    arm: str
    users: int
    sums: dict[str, float]
    """Rollup column -> its sum over the window."""
    latency_histogram: list[tuple[int, int]]
    """(bucket, count), bucket ascending."""

    @property
    def requests(self) -> int:
        return int(self.sums.get("requests", 0))

    @property
    def fallback_requests(self) -> int:
        return int(self.sums.get("fallback_requests", 0))

    def proportion(self, name: str) -> tuple[int, int]:
        """(successes, observations) of a proportion metric."""
        successes, observations = PROPORTIONS[name]
        return int(self.sums.get(successes, 0)), int(self.sums.get(observations, 0))

    def mean(self, name: str) -> tuple[float | None, float | None, int]:
        """(mean, sample variance, observations) of a mean metric."""
        count_column, sum_column, sumsq_column = MEANS[name]
        n = int(self.sums.get(count_column, 0))
        if n == 0:
            return None, None, 0
        total, squares = self.sums[sum_column], self.sums[sumsq_column]
        mean = total / n
        variance = max(0.0, (squares - total * mean) / (n - 1)) if n > 1 else None
        return mean, variance, n


def _hours(query: Select[Any], since: datetime | None, until: datetime | None) -> Select[Any]:
    if since is not None:
        query = query.where(rollups.c.hour >= since)
    if until is not None:
        query = query.where(rollups.c.hour < until)
    return query


def arm_sums_query(
    experiment_id: int, since: datetime | None, until: datetime | None
) -> Select[Any]:
    query = (
        select(rollups.c.arm, *(func.sum(rollups.c[name]).label(name) for name in _SUMMED))
        .where(rollups.c.experiment_id == experiment_id, rollups.c.arm.is_not(None))
        .group_by(rollups.c.arm)
    )
    return _hours(query, since, until)


def arm_histogram_query(
    experiment_id: int, since: datetime | None, until: datetime | None
) -> Select[Any]:
    cells = (
        func.unnest(rollups.c.latency_buckets, rollups.c.latency_counts)
        .table_valued("bucket", "count")
        .render_derived(name="cell")
    )
    query = (
        select(rollups.c.arm, cells.c.bucket, func.sum(cells.c.count).label("requests"))
        .select_from(rollups.join(cells, true()))
        .where(rollups.c.experiment_id == experiment_id, rollups.c.arm.is_not(None))
        .group_by(rollups.c.arm, cells.c.bucket)
        .order_by(rollups.c.arm, cells.c.bucket)
    )
    return _hours(query, since, until)


def arm_users_query(experiment_id: int, since: date | None, until: date | None) -> Select[Any]:
    """Distinct users per arm: over the whole experiment, or on the window's days."""
    if since is None and until is None:
        return (
            select(experiment_users.c.arm, func.count().label("users"))
            .where(experiment_users.c.experiment_id == experiment_id)
            .group_by(experiment_users.c.arm)
        )
    in_window = (
        select(user_days.c.arm, user_days.c.user_hash)
        .where(user_days.c.experiment_id == experiment_id)
        .distinct()
    )
    if since is not None:
        in_window = in_window.where(user_days.c.day >= since)
    if until is not None:
        in_window = in_window.where(user_days.c.day < until)
    users = in_window.subquery()
    return select(users.c.arm, func.count().label("users")).group_by(users.c.arm)


def _summaries(
    sums: Sequence[Row[Any]], histogram: Sequence[Row[Any]], users: Sequence[Row[Any]]
) -> list[ArmSummary]:
    cells: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for row in histogram:
        cells[row.arm].append((int(row.bucket), int(row.requests)))
    users_by_arm = {row.arm: int(row.users) for row in users}
    return [
        ArmSummary(
            arm=row.arm,
            users=users_by_arm.get(row.arm, 0),
            sums={name: float(row._mapping[name] or 0) for name in _SUMMED},
            latency_histogram=cells[row.arm],
        )
        for row in sums
    ]


async def arm_summaries(
    session: AsyncSession, experiment_id: int, since: datetime | None, until: datetime | None
) -> list[ArmSummary]:
    """Per-arm summaries of an experiment over whole UTC days [since, until)."""
    sums = (await session.execute(arm_sums_query(experiment_id, since, until))).all()
    histogram = (await session.execute(arm_histogram_query(experiment_id, since, until))).all()
    users_query = arm_users_query(
        experiment_id, since.date() if since else None, until.date() if until else None
    )
    users = (await session.execute(users_query)).all()
    return _summaries(sums, histogram, users)


def arm_summaries_sync(
    session: Session, experiment_id: int, since: datetime | None, until: datetime | None
) -> list[ArmSummary]:
    """`arm_summaries` for synchronous callers (guardrails)."""
    sums = session.execute(arm_sums_query(experiment_id, since, until)).all()
    histogram = session.execute(arm_histogram_query(experiment_id, since, until)).all()
    users_query = arm_users_query(
        experiment_id, since.date() if since else None, until.date() if until else None
    )
    return _summaries(sums, histogram, session.execute(users_query).all())


def timeseries_query(
    bucket: Bucket,
    checkpoints: list[str] | None,
    since: datetime | None,
    until: datetime | None,
) -> Select[Any]:
    """Requests, kept rate, mean reward and dissatisfied rate per checkpoint and time bucket."""
    start = func.date_trunc(bucket, rollups.c.hour, "UTC").label("bucket_start")
    total = func.sum
    query = (
        select(
            rollups.c.checkpoint,
            start,
            total(rollups.c.requests).label("requests"),
            (total(rollups.c.kept_sum) / func.nullif(total(rollups.c.kept_n), 0)).label("kept"),
            total(rollups.c.kept_n).label("kept_n"),
            (total(rollups.c.reward_sum) / func.nullif(total(rollups.c.reward_n), 0)).label(
                "mean_reward"
            ),
            total(rollups.c.reward_n).label("reward_n"),
            (
                cast(total(rollups.c.dissatisfied), Float)
                / func.nullif(total(rollups.c.dissatisfied_observed), 0)
            ).label("dissatisfied_rate"),
            total(rollups.c.dissatisfied_observed).label("dissatisfied_n"),
        )
        .group_by(rollups.c.checkpoint, start)
        .order_by(rollups.c.checkpoint, start)
    )
    if checkpoints:
        query = query.where(rollups.c.checkpoint.in_(checkpoints))
    return _hours(query, since, until)


_components = rewards.c.components
_final = and_(rewards.c.sample_id == samples.c.id, rewards.c.finalized_at.is_not(None))

SAMPLE_EXPORT_COLUMNS: tuple[ColumnElement[Any], ...] = (
    samples.c.id,
    samples.c.request_id,
    samples.c.session_id,
    samples.c.served_at,
    samples.c.user_hash,
    samples.c.checkpoint,
    samples.c.experiment_id,
    samples.c.arm,
    samples.c.fallback,
    samples.c.edit_requested,
    samples.c.proposed_edit,
    samples.c.clarifying_question,
    samples.c.status,
    samples.c.ttft_ms,
    samples.c.latency_ms,
    samples.c.completion_chars,
    samples.c.tool_calls,
    samples.c.malformed_tool_calls,
    cast(_components["accepted"].astext, Boolean).label("accepted"),
    cast(_components["kept"].astext, Float).label("kept"),
    cast(_components["dissatisfied"].astext, Boolean).label("dissatisfied"),
    rewards.c.reward,
    rewards.c.reward_version,
)


def sample_export_query(
    experiment_id: int, arm: str | None, since: datetime | None, until: datetime | None
) -> Select[Any]:
    """Per-sample rows of an experiment with their final rewards; never prompts or text."""
    query = (
        select(*SAMPLE_EXPORT_COLUMNS)
        .select_from(samples.outerjoin(rewards, _final))
        .where(samples.c.experiment_id == experiment_id)
        .order_by(samples.c.served_at, samples.c.id)
    )
    if arm is not None:
        query = query.where(samples.c.arm == arm)
    if since is not None:
        query = query.where(samples.c.served_at >= since)
    if until is not None:
        query = query.where(samples.c.served_at < until)
    return query
