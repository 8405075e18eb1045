from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    DateTime,
    Float,
    ForeignKeyConstraint,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.engine.default import DefaultExecutionContext
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base


def _served_at_of_sample(context: DefaultExecutionContext) -> datetime:
    sample_id = context.get_current_parameters()["sample_id"]
    served_at: datetime = context.connection.scalar(
        text("SELECT served_at FROM samples WHERE id = :id"), {"id": sample_id}
    )
    return served_at


class Reward(Base):
    """The one reward record of a sample; components are kept raw for replays.

    Partitioned like its sample, by the sample's `served_at` (copied here): the key of an
    upsert is the same whichever delivery or sweep writes it.
    """

    __tablename__ = "rewards"
    __table_args__ = (
        PrimaryKeyConstraint("sample_id", "served_at"),
        ForeignKeyConstraint(
            ["sample_id", "served_at"], ["samples.id", "samples.served_at"], ondelete="CASCADE"
        ),
        # The finalization sweep scans only what is still open and due.
        Index("ix_rewards_open_due_at", "due_at", postgresql_where=text("finalized_at IS NULL")),
        Index("ix_rewards_finalized_at", "finalized_at"),
        # Which rewards changed since the analytics rollup last looked.
        Index("ix_rewards_updated_at_brin", "updated_at", postgresql_using="brin"),
        {"postgresql_partition_by": "RANGE (served_at)"},
    )

    sample_id: Mapped[int] = mapped_column(BigInteger, autoincrement=False)
    served_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=_served_at_of_sample
    )
    """The sample's, so the reward lives in the same day's partition (looked up when an
    insert through SQLAlchemy leaves it out)."""
    components: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    reward: Mapped[float | None] = mapped_column(Float)
    reward_version: Mapped[int] = mapped_column(Integer, nullable=False)
    due_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    finalized_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalize_reason: Mapped[str | None] = mapped_column(String(32))
    reopen_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    """Times evidence arrived after finalization, within the reopen window, and was applied."""
    late_evidence_count: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    """Evidence that arrived after the reopen window: stored, counted, not applied."""
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
