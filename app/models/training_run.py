from __future__ import annotations

import enum
from datetime import datetime
from typing import Any

from sqlalchemy import DateTime, Enum, ForeignKey, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base


class TrainingRunStatus(enum.StrEnum):
    running = "running"
    skipped = "skipped"
    refused = "refused"
    rejected = "rejected"
    published = "published"
    failed = "failed"


class CycleTrigger(enum.StrEnum):
    schedule = "schedule"
    request = "request"
    manual = "manual"


class TrainingRun(Base):
    """One training cycle: its inputs, statistics, evaluation and outcome."""

    __tablename__ = "training_runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    status: Mapped[TrainingRunStatus] = mapped_column(
        Enum(
            TrainingRunStatus,
            name="training_run_status",
            native_enum=False,
            create_constraint=True,
            length=16,
        ),
        nullable=False,
        index=True,
    )
    reason: Mapped[str | None] = mapped_column(Text)
    config: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    eval_results: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    prediction: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    """The candidate's A/B predicted from production's logged samples before its canary
    (`trainer.prediction`): per traffic kind and metric, the difference, interval and
    diagnostics."""
    base_checkpoint_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    output_checkpoint_id: Mapped[int | None] = mapped_column(
        ForeignKey("checkpoints.id"), index=True
    )
    window_start: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    window_end: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    sample_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    run_name: Mapped[str | None] = mapped_column(String(128))
    trigger: Mapped[CycleTrigger | None] = mapped_column(
        Enum(
            CycleTrigger,
            name="cycle_trigger",
            native_enum=False,
            create_constraint=True,
            length=16,
        )
    )
    """What started it: the schedule, an ops request, or `rtrl train --once`."""
    trainer: Mapped[str | None] = mapped_column(String(200))
    """The trainer process that ran it, as host:pid."""
    started_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class TrainingSchedule(Base):
    """When a route's next scheduled training cycle is due; trainers advance it as they take it."""

    __tablename__ = "training_schedule"

    route: Mapped[str] = mapped_column(String(64), primary_key=True)
    due_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
