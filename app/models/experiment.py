from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    String,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, CreatedAt


class ExperimentStatus(enum.StrEnum):
    draft = "draft"
    running = "running"
    stopped = "stopped"


class Experiment(CreatedAt, Base):
    """An A/B test: users hashed with `salt` into arms by basis-point weights."""

    __tablename__ = "experiments"
    __table_args__ = (
        Index(
            "uq_experiments_running_route",
            "route",
            unique=True,
            postgresql_where=text("status = 'running'"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), nullable=False, unique=True)
    route: Mapped[str] = mapped_column(String(64), nullable=False, server_default="chat")
    salt: Mapped[str] = mapped_column(String(64), nullable=False)
    status: Mapped[ExperimentStatus] = mapped_column(
        Enum(
            ExperimentStatus,
            name="experiment_status",
            native_enum=False,
            create_constraint=True,
            length=16,
        ),
        nullable=False,
    )
    created_by: Mapped[str | None] = mapped_column(String(200))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    arms: Mapped[list[Arm]] = relationship(
        back_populates="experiment", order_by="Arm.id", cascade="all, delete-orphan"
    )


class Arm(Base):
    __tablename__ = "arms"
    __table_args__ = (
        UniqueConstraint("experiment_id", "name", name="uq_arms_experiment_id_name"),
        CheckConstraint("weight_bps BETWEEN 0 AND 10000", name="weight_bps_range"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    experiment_id: Mapped[int] = mapped_column(
        ForeignKey("experiments.id", ondelete="CASCADE"), nullable=False, index=True
    )
    name: Mapped[str] = mapped_column(String(64), nullable=False)
    checkpoint_id: Mapped[int] = mapped_column(
        ForeignKey("checkpoints.id"), nullable=False, index=True
    )
    weight_bps: Mapped[int] = mapped_column(Integer, nullable=False)
    is_control: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")

    experiment: Mapped[Experiment] = relationship(back_populates="arms")
