"""The analytics reads: per-arm sums over users, latency histograms, trends; raw exports.

Results are computed per user (the unit of randomization): each user counts in the arm of
their first exposure, with their requests summed into one numerator and one denominator per
metric; users seen in more than one arm (moved by a ramp, or by a stopped arm) are counted
apart and left out. Per arm the reads return the sums the delta method needs: of each
per-user value, of its square, and of each metric's numerator times denominator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from typing import Any, Literal

from sqlalchemy import (
    Boolean,
    ColumnElement,
    Float,
    Row,
    Select,
    TextClause,
    and_,
    bindparam,
    cast,
    func,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session
from sqlalchemy.types import DateTime

from app.models import AuditEntry, HourlyRollup, Reward, Sample

Bucket = Literal["hour", "day"]

rollups = HourlyRollup.__table__
samples = Sample.__table__
rewards = Reward.__table__

RATIOS: dict[str, tuple[str, str]] = {
    # name: (numerator, denominator), both summed per user
    "acceptance_rate": ("accepted", "accept_observed"),
    "kept": ("kept_sum", "kept_n"),
    "dissatisfied_rate": ("dissatisfied", "dissatisfied_observed"),
    "mean_reward": ("reward_sum", "reward_n"),
    "edit_rate": ("edits_proposed", "edits_requested"),
    "malformed_call_rate": ("malformed_responses", "tool_call_responses"),
    "error_rate": ("errors", "requests"),
    "latency_over_budget_rate": ("over_budget", "final_rewards"),
    "latency_mean_ms": ("latency_sum", "requests"),
    # Final edits whose fate was never seen (censored): a policy that learns to dodge the
    # evidence (ending before the client shows what became of its edit) raises it.
    "censored_edit_rate": ("edits_censored", "edits_final"),
}
REQUEST_SQUARES: dict[str, str] = {
    # metrics whose per-request values are not 0/1: the sum of their squares over requests
    "kept": "kept_sumsq",
    "mean_reward": "reward_sumsq",
    "latency_mean_ms": "latency_sumsq",
}
PRE_PERIOD = timedelta(days=14)
"""CUPED's covariate: each user's value of the metric over these whole days before the start."""
_PER_USER = sorted({column for pair in RATIOS.values() for column in pair} | {"fallback_requests"})


@dataclass(frozen=True)
class Moments:
    """Sums over users of per-user values: of each value, of its square, of each product."""

    users: int = 0
    sums: dict[str, float] = field(default_factory=dict)
    squares: dict[str, float] = field(default_factory=dict)
    products: dict[tuple[str, str], float] = field(default_factory=dict)

    def sum(self, column: str) -> float:
        return self.sums.get(column, 0.0)

    def square(self, column: str) -> float:
        return self.squares.get(column, 0.0)

    def product(self, a: str, b: str) -> float:
        if a == b:
            return self.square(a)
        return self.products.get((a, b), self.products.get((b, a), 0.0))


@dataclass(frozen=True)
class ArmSummary:
    """Everything the statistics need about one arm, over the users first exposed to it."""

    arm: str
    moments: Moments
    """Per-user sums of the analysed users (those seen in this arm only)."""
    switched_users: int = 0
    """Users first exposed to this arm and later seen in another: reported, left out."""
    first_exposures: dict[int, int] = field(default_factory=dict)
    """Users (all, switched included) by the ramp period of their first exposure."""
    request_sums: dict[str, float] = field(default_factory=dict)
    """Sums over requests: the per-request squares of `REQUEST_SQUARES`."""
    latency_histogram: list[tuple[int, int]] = field(default_factory=list)
    """(bucket, requests), bucket ascending, over every request the arm served."""
    latency_groups: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    """User group -> (10% bucket, requests), bucket ascending."""
    cuped: bool = False
    """`moments` also hold the users' pre-experiment sums (columns prefixed "pre_") and
    their products with the experiment's sums."""

    @property
    def users(self) -> int:
        return self.moments.users

    @property
    def requests(self) -> int:
        return int(self.moments.sum("requests"))

    @property
    def fallback_requests(self) -> int:
        return int(self.moments.sum("fallback_requests"))

    def ratio(self, name: str) -> tuple[float, float]:
        """(numerator, denominator) of a metric, summed over the arm's users."""
        numerator, denominator = RATIOS[name]
        return self.moments.sum(numerator), self.moments.sum(denominator)


@dataclass(frozen=True)
class WeightPeriod:
    """Arm weights in force from `start` (None: the experiment's start) until the next."""

    start: datetime | None
    weights: dict[str, int]


def weight_history_query(experiment_id: int) -> Select[Any]:
    """The experiment's ramps from the audit log, oldest first."""
    return (
        select(AuditEntry.at, AuditEntry.before, AuditEntry.after)
        .where(
            AuditEntry.target == f"experiment:{experiment_id}",
            AuditEntry.action == "experiment.ramp",
        )
        .order_by(AuditEntry.at, AuditEntry.id)
    )


def weight_periods(rows: Sequence[Row[Any]], current: dict[str, int]) -> list[WeightPeriod]:
    """The weights in force over time: before the first ramp, then after each."""

    def weights(state: dict[str, Any] | None) -> dict[str, int]:
        return {arm["name"]: int(arm["weight_bps"]) for arm in (state or {}).get("arms", [])}

    if not rows:
        return [WeightPeriod(None, current)]
    periods = [WeightPeriod(None, weights(rows[0].before) or current)]
    periods += [WeightPeriod(row.at, weights(row.after) or current) for row in rows]
    return periods


def _per_user_columns(table: str) -> str:
    return ", ".join(f"sum({table}.{c}) AS {c}" for c in [*_PER_USER, *REQUEST_SQUARES.values()])


def _moment_columns(columns: Sequence[str], pairs: Sequence[tuple[str, str]]) -> str:
    analysed = "arms_seen = 1"
    parts = [f"sum({c}) FILTER (WHERE {analysed}) AS s__{c}" for c in columns]
    parts += [f"sum({c} * {c}) FILTER (WHERE {analysed}) AS q__{c}" for c in columns]
    parts += [f"sum({a} * {b}) FILTER (WHERE {analysed}) AS p__{a}__{b}" for a, b in pairs]
    return ",\n       ".join(parts)


_RATIO_PAIRS = list(RATIOS.values())
_PRE_PAIRS = [
    pair
    for numerator, denominator in RATIOS.values()
    for pair in (
        (f"pre_{numerator}", f"pre_{denominator}"),
        (numerator, f"pre_{numerator}"),
        (numerator, f"pre_{denominator}"),
        (denominator, f"pre_{numerator}"),
        (denominator, f"pre_{denominator}"),
    )
]
_PRE_COLUMNS = sorted({f"pre_{c}" for pair in RATIOS.values() for c in pair})


def arm_users_statement(*, window: bool, ramps: int, cuped: bool) -> TextClause:
    """Per arm and ramp period: users, switched users and the per-user moments.

    Binds: experiment_id; with `window`, since and until (days); with `ramps`, the ramp
    times; with `cuped`, pre_since and pre_until (days).
    """
    exposure = """
        SELECT user_hash, (array_agg(arm ORDER BY first_served_at, arm))[1] AS arm,
               min(first_served_at) AS first_served_at, count(*) AS arms_seen
        FROM experiment_users WHERE experiment_id = :experiment_id GROUP BY user_hash"""
    if window:
        per_user = f"""
        SELECT d.user_hash, e.arm, e.first_served_at, e.arms_seen, {_per_user_columns("d")}
        FROM experiment_user_days d JOIN exposure e ON e.user_hash = d.user_hash
        WHERE d.experiment_id = :experiment_id AND d.day >= :since AND d.day < :until
        GROUP BY d.user_hash, e.arm, e.first_served_at, e.arms_seen"""
    else:
        per_user = f"""
        SELECT user_hash, (array_agg(arm ORDER BY first_served_at, arm))[1] AS arm,
               min(first_served_at) AS first_served_at, count(*) AS arms_seen,
               {_per_user_columns("experiment_users")}
        FROM experiment_users WHERE experiment_id = :experiment_id GROUP BY user_hash"""
    source = "per_user"
    pre = ""
    if cuped:
        pre_sums = ", ".join(f"coalesce(sum(p.{c}), 0) AS pre_{c}" for c in _PER_USER)
        pre = f""",
    with_pre AS (
        SELECT per_user.*, {", ".join(f"pre.pre_{c}" for c in _PER_USER)}
        FROM per_user CROSS JOIN LATERAL (
            SELECT {pre_sums} FROM user_days p
            WHERE p.user_hash = per_user.user_hash
              AND p.day >= :pre_since AND p.day < :pre_until
        ) pre
    )"""
        source = "with_pre"
    period = "width_bucket(first_served_at, CAST(:ramps AS timestamptz[]))" if ramps else "0"
    moments = _moment_columns([*_PER_USER, *REQUEST_SQUARES.values()], _RATIO_PAIRS)
    if cuped:
        moments += ",\n       " + _moment_columns(_PRE_COLUMNS, _PRE_PAIRS)
    statement = text(
        f"""
    WITH {f"exposure AS ({exposure})," if window else ""}
    per_user AS ({per_user}){pre}
    SELECT arm, {period} AS period,
           count(*) AS exposed,
           count(*) FILTER (WHERE arms_seen = 1) AS users,
           count(*) FILTER (WHERE arms_seen > 1) AS switched_users,
       {moments}
    FROM {source} GROUP BY arm, period"""
    )
    if ramps:
        statement = statement.bindparams(bindparam("ramps", type_=ARRAY(DateTime(timezone=True))))
    return statement


def latency_statement(*, window: bool, groups: bool) -> TextClause:
    """Per arm (and user group) latency histograms, bucket ascending."""
    table = "experiment_latency_groups" if groups else "experiment_latency"
    keys = "arm, user_group, bucket" if groups else "arm, bucket"
    in_window = " AND day >= :since AND day < :until" if window else ""
    return text(
        f"SELECT {keys}, sum(requests) AS requests FROM {table} "
        f"WHERE experiment_id = :experiment_id{in_window} GROUP BY {keys} ORDER BY {keys}"
    )


@dataclass(frozen=True)
class Reads:
    """The statements and parameters of one experiment's per-arm reads."""

    users: TextClause
    histogram: TextClause
    groups: TextClause
    params: dict[str, Any]


def arm_reads(
    experiment_id: int,
    since: date | None,
    until: date | None,
    ramps: Sequence[datetime] = (),
    pre_until: date | None = None,
) -> Reads:
    """The reads of `arm_summaries` for whole UTC days [since, until), CUPED with `pre_until`."""
    window = since is not None or until is not None
    params: dict[str, Any] = {"experiment_id": experiment_id}
    if window:
        params |= {"since": since or date.min, "until": until or date.max}
    if ramps:
        params["ramps"] = list(ramps)
    if pre_until is not None:
        params |= {"pre_since": pre_until - PRE_PERIOD, "pre_until": pre_until}
    return Reads(
        users=arm_users_statement(window=window, ramps=len(ramps), cuped=pre_until is not None),
        histogram=latency_statement(window=window, groups=False),
        groups=latency_statement(window=window, groups=True),
        params=params,
    )


def _moments(rows: Sequence[Row[Any]], columns: Sequence[str]) -> Moments:
    def total(key: str) -> float:
        return float(sum(row._mapping[key] or 0 for row in rows))

    keys = [key for key in rows[0]._mapping if key.startswith("p__")] if rows else []
    products: dict[tuple[str, str], float] = {}
    for key in keys:
        _, a, b = key.split("__")
        products[(a, b)] = total(key)
    return Moments(
        users=int(sum(row.users for row in rows)),
        sums={c: total(f"s__{c}") for c in columns},
        squares={c: total(f"q__{c}") for c in columns},
        products=products,
    )


def summaries_from_rows(
    users: Sequence[Row[Any]],
    histogram: Sequence[Row[Any]],
    groups: Sequence[Row[Any]],
    cuped: bool,
) -> list[ArmSummary]:
    """Per-arm summaries from the rows of the three reads."""
    by_arm: dict[str, list[Row[Any]]] = defaultdict(list)
    for row in users:
        by_arm[row.arm].append(row)
    cells: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for row in histogram:
        cells[row.arm].append((int(row.bucket), int(row.requests)))
    grouped: dict[str, dict[int, list[tuple[int, int]]]] = defaultdict(lambda: defaultdict(list))
    for row in groups:
        grouped[row.arm][int(row.user_group)].append((int(row.bucket), int(row.requests)))
    columns = [*_PER_USER, *REQUEST_SQUARES.values(), *(_PRE_COLUMNS if cuped else [])]
    summaries = []
    for arm in sorted(by_arm.keys() | cells.keys()):
        rows = by_arm.get(arm, [])
        moments = _moments(rows, columns)
        summaries.append(
            ArmSummary(
                arm=arm,
                moments=moments,
                switched_users=int(sum(row.switched_users for row in rows)),
                first_exposures={int(row.period): int(row.exposed) for row in rows},
                request_sums={c: moments.sum(c) for c in REQUEST_SQUARES.values()},
                latency_histogram=cells.get(arm, []),
                latency_groups=dict(grouped.get(arm, {})),
                cuped=cuped,
            )
        )
    return summaries


async def arm_summaries(session: AsyncSession, reads: Reads) -> list[ArmSummary]:
    """Per-arm summaries of an experiment (see `arm_reads`)."""
    users = (await session.execute(reads.users, reads.params)).all()
    histogram = (await session.execute(reads.histogram, reads.params)).all()
    groups = (await session.execute(reads.groups, reads.params)).all()
    return summaries_from_rows(users, histogram, groups, "pre_until" in reads.params)


def arm_summaries_sync(session: Session, reads: Reads) -> list[ArmSummary]:
    """`arm_summaries` for synchronous callers (guardrails, benchmarks)."""
    users = session.execute(reads.users, reads.params).all()
    histogram = session.execute(reads.histogram, reads.params).all()
    groups = session.execute(reads.groups, reads.params).all()
    return summaries_from_rows(users, histogram, groups, "pre_until" in reads.params)


def _hours(query: Select[Any], since: datetime | None, until: datetime | None) -> Select[Any]:
    if since is not None:
        query = query.where(rollups.c.hour >= since)
    if until is not None:
        query = query.where(rollups.c.hour < until)
    return query


def timeseries_query(
    bucket: Bucket,
    checkpoints: list[str] | None,
    since: datetime | None,
    until: datetime | None,
) -> Select[Any]:
    """Requests, kept rate, mean reward, dissatisfied rate and censored edit rate per
    checkpoint and time bucket."""
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
            (
                cast(total(rollups.c.edits_censored), Float)
                / func.nullif(total(rollups.c.edits_final), 0)
            ).label("censored_edit_rate"),
            total(rollups.c.edits_final).label("edits_final"),
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
