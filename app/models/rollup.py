from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    Date,
    DateTime,
    Float,
    Integer,
    PrimaryKeyConstraint,
    String,
)
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base

COUNTS = (
    "requests",
    "fallback_requests",
    "errors",
    "edits_requested",
    "edits_proposed",
    "tool_call_responses",
    "malformed_responses",
    "final_rewards",
    "over_budget",
    "accept_observed",
    "accepted",
    "dissatisfied_observed",
    "dissatisfied",
    "kept_n",
    "reward_n",
    "edits_final",
    "edits_censored",
)
TOTALS = (
    "kept_sum",
    "kept_sumsq",
    "reward_sum",
    "reward_sumsq",
    "latency_sum",
    "latency_sumsq",
)
SUMMED = COUNTS + TOTALS
"""The columns every rollup sums: each metric's numerator and denominator, and the squares
of per-request values (for request-level figures)."""


class MetricSums:
    """Samples and their final rewards summed: every metric's numerator and denominator."""

    requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    fallback_requests: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    edits_requested: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    edits_proposed: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    tool_call_responses: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    malformed_responses: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    final_rewards: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    over_budget: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    accept_observed: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    accepted: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    dissatisfied_observed: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    dissatisfied: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    kept_n: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    reward_n: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    edits_final: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    """Final rewards of answers that proposed an edit."""
    edits_censored: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    """Of those, the edits whose fate was never seen (kept unknown: censored)."""
    kept_sum: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    kept_sumsq: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    reward_sum: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    reward_sumsq: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    latency_sum: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    latency_sumsq: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)


class HourlyRollup(MetricSums, Base):
    """Every checkpoint's samples and final rewards summed per hour: the trends.

    Derived data, like every table here: `app.abtest.rollups.refresh_rollups` adds what
    arrived or changed since its last refresh.
    """

    __tablename__ = "hourly_rollups"
    __table_args__ = (PrimaryKeyConstraint("hour", "checkpoint"),)

    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    checkpoint: Mapped[str] = mapped_column(String(64), nullable=False)


class ExperimentUser(MetricSums, Base):
    """One user's sums in one arm over the whole experiment: the unit of analysis."""

    __tablename__ = "experiment_users"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "user_hash"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    first_served_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    """The user's first request in this arm: the arm of the earliest is their first exposure."""


class ExperimentUserDay(MetricSums, Base):
    """One user's sums in one arm on one UTC day: results over a window of days."""

    __tablename__ = "experiment_user_days"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "day", "user_hash"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)


class UserDay(MetricSums, Base):
    """One user's sums on one UTC day over all traffic: pre-experiment values for CUPED."""

    __tablename__ = "user_days"
    __table_args__ = (PrimaryKeyConstraint("user_hash", "day"),)

    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False)


class ExperimentLatency(Base):
    """An arm's latency histogram per UTC day, in 2%-wide log buckets (see rollups)."""

    __tablename__ = "experiment_latency"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "day", "bucket"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False)
    bucket: Mapped[int] = mapped_column(Integer, nullable=False)
    """Bucket b holds [1.02**b, 1.02**(b+1)) ms."""
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)


class ExperimentLatencyGroup(Base):
    """An arm's latency histogram per day and user group, in 10%-wide buckets: the user
    clusters behind a percentile's standard error."""

    __tablename__ = "experiment_latency_groups"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "day", "user_group", "bucket"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False)
    user_group: Mapped[int] = mapped_column(Integer, nullable=False)
    bucket: Mapped[int] = mapped_column(Integer, nullable=False)
    """Five 2% buckets: bucket g holds the fine buckets 5g .. 5g + 4."""
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)


class RolledUpReward(Base):
    """The part of a final reward the rollups counted, so a changed reward is replaced.

    No foreign key to samples: checking one per row doubled the cost of writing it, and a
    row left behind by a deleted sample is never read (sample ids are not reused).
    """

    __tablename__ = "rolled_up_rewards"

    sample_id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    accepted: Mapped[bool | None] = mapped_column(Boolean)
    dissatisfied: Mapped[bool | None] = mapped_column(Boolean)
    over_budget: Mapped[bool] = mapped_column(Boolean, nullable=False)
    kept: Mapped[float | None] = mapped_column(Float)
    reward: Mapped[float | None] = mapped_column(Float)


class RollupState(Base):
    """How far the rollups are current: rows stamped before `watermark` are counted."""

    __tablename__ = "rollup_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    watermark: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    refreshed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
