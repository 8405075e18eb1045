from __future__ import annotations

import enum
from datetime import datetime

from sqlalchemy import DateTime, Enum, ForeignKey, Index, Integer, Sequence, String, Text, text
from sqlalchemy.orm import Mapped, mapped_column, relationship

from app.models.base import Base, CreatedAt


class CheckpointStatus(enum.StrEnum):
    candidate = "candidate"
    canary = "canary"
    production = "production"
    retired = "retired"
    rolled_back = "rolled_back"


# Numbers for `ckpt-<n>` names; a sequence never hands out a number twice, even when the
# transaction that drew it rolls back, so names are never reused.
CHECKPOINT_NUMBER_SEQ = Sequence("checkpoint_number_seq", metadata=Base.metadata)

LIVE_STATUSES = (CheckpointStatus.candidate, CheckpointStatus.canary, CheckpointStatus.production)


class Checkpoint(CreatedAt, Base):
    """A servable policy: the base model (no adapter) or a LoRA adapter on it."""

    __tablename__ = "checkpoints"
    __table_args__ = (
        # At most one production checkpoint, enforced by the database.
        Index(
            "uq_checkpoints_single_production",
            "status",
            unique=True,
            postgresql_where=text("status = 'production'"),
        ),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), nullable=False, unique=True)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"), index=True)
    status: Mapped[CheckpointStatus] = mapped_column(
        Enum(
            CheckpointStatus,
            name="checkpoint_status",
            native_enum=False,
            create_constraint=True,
            length=16,
        ),
        nullable=False,
    )
    base_model: Mapped[str] = mapped_column(Text, nullable=False)
    adapter_path: Mapped[str | None] = mapped_column(Text)
    """Directory of the HF PEFT adapter; NULL for the base model itself."""
    reward_version: Mapped[int | None] = mapped_column(Integer)
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    promoted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    retired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    superseded_by_id: Mapped[int | None] = mapped_column(ForeignKey("checkpoints.id"))
    """The newer candidate of the same parent that replaced this canary."""

    parent: Mapped[Checkpoint | None] = relationship(remote_side=[id], foreign_keys=[parent_id])
