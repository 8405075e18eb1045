from __future__ import annotations

from datetime import date, datetime

from sqlalchemy import (
    BigInteger,
    Date,
    DateTime,
    Float,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base


class HourlyRollup(Base):
    """Samples and their final rewards summed per hour, checkpoint and arm, for analytics.

    Derived data: `app.abtest.rollups.refresh_rollups` rebuilds the hours whose samples
    or rewards changed. Sums and sums of squares give means and variances; latency is a
    log-bucketed histogram (2% wide buckets), so percentiles merge across hours.
    """

    __tablename__ = "hourly_rollups"
    __table_args__ = (
        Index("ix_hourly_rollups_experiment_id_hour", "experiment_id", "hour"),
        Index("ix_hourly_rollups_hour", "hour"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    hour: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    checkpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    experiment_id: Mapped[int | None] = mapped_column(Integer)
    arm: Mapped[str | None] = mapped_column(String(64))
    requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    fallback_requests: Mapped[int] = mapped_column(BigInteger, nullable=False)
    errors: Mapped[int] = mapped_column(BigInteger, nullable=False)
    edits_requested: Mapped[int] = mapped_column(BigInteger, nullable=False)
    edits_proposed: Mapped[int] = mapped_column(BigInteger, nullable=False)
    tool_call_responses: Mapped[int] = mapped_column(BigInteger, nullable=False)
    malformed_responses: Mapped[int] = mapped_column(BigInteger, nullable=False)
    final_rewards: Mapped[int] = mapped_column(BigInteger, nullable=False)
    over_budget: Mapped[int] = mapped_column(BigInteger, nullable=False)
    accept_observed: Mapped[int] = mapped_column(BigInteger, nullable=False)
    accepted: Mapped[int] = mapped_column(BigInteger, nullable=False)
    dissatisfied_observed: Mapped[int] = mapped_column(BigInteger, nullable=False)
    dissatisfied: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kept_n: Mapped[int] = mapped_column(BigInteger, nullable=False)
    kept_sum: Mapped[float] = mapped_column(Float, nullable=False)
    kept_sumsq: Mapped[float] = mapped_column(Float, nullable=False)
    reward_n: Mapped[int] = mapped_column(BigInteger, nullable=False)
    reward_sum: Mapped[float] = mapped_column(Float, nullable=False)
    reward_sumsq: Mapped[float] = mapped_column(Float, nullable=False)
    latency_sum: Mapped[float] = mapped_column(Float, nullable=False)
    latency_sumsq: Mapped[float] = mapped_column(Float, nullable=False)
    latency_buckets: Mapped[list[int]] = mapped_column(ARRAY(Integer), nullable=False)
    """Occupied histogram buckets, ascending; bucket b holds [1.02**b, 1.02**(b+1)) ms."""
    latency_counts: Mapped[list[int]] = mapped_column(ARRAY(Integer), nullable=False)


class ExperimentUser(Base):
    """A user seen in an experiment's arm: the arm's users over the whole experiment."""

    __tablename__ = "experiment_users"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "user_hash"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)


class ExperimentUserDay(Base):
    """A user seen in an experiment's arm on a UTC day: the arm's users within a window."""

    __tablename__ = "experiment_user_days"
    __table_args__ = (PrimaryKeyConstraint("experiment_id", "arm", "day", "user_hash"),)

    experiment_id: Mapped[int] = mapped_column(Integer, nullable=False)
    arm: Mapped[str] = mapped_column(String(64), nullable=False)
    day: Mapped[date] = mapped_column(Date, nullable=False)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)


class RollupState(Base):
    """How far the rollups are current: rows written before `watermark` are included."""

    __tablename__ = "rollup_state"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    watermark: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    refreshed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
