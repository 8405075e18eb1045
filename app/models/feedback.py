from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    Float,
    Index,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    func,
)
from sqlalchemy.dialects.postgresql import UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base


class FeedbackKind(enum.StrEnum):
    edit_accepted = "edit_accepted"
    edit_rejected = "edit_rejected"
    edit_survival = "edit_survival"
    followup_message = "followup_message"
    session_end = "session_end"


class FeedbackEventRow(Base):
    """An IDE signal about a completion; may arrive before the completion itself.

    Partitioned by day of `occurred_at`, the event's own time: it travels in the event, so
    every delivery of it lands on (and conflicts in) the same partition.
    """

    __tablename__ = "feedback_events"
    __table_args__ = (
        PrimaryKeyConstraint("id", "occurred_at"),
        UniqueConstraint("event_id", "occurred_at", name="uq_feedback_events_event_id"),
        Index("ix_feedback_events_request_id", "request_id"),
        Index("ix_feedback_events_session_occurred_at", "session_id", "occurred_at"),
        {"postgresql_partition_by": "RANGE (occurred_at)"},
    )

    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    session_id: Mapped[str] = mapped_column(String(128), nullable=False)
    kind: Mapped[FeedbackKind] = mapped_column(
        Enum(
            FeedbackKind, name="feedback_kind", native_enum=False, create_constraint=True, length=32
        ),
        nullable=False,
    )
    elapsed_s: Mapped[float | None] = mapped_column(Float)
    surviving_share: Mapped[float | None] = mapped_column(Float)
    message: Mapped[str | None] = mapped_column(Text)
    dissatisfied: Mapped[bool | None] = mapped_column(Boolean)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    """A `session_end`'s key: it ends that key's completions of the session only."""
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
    source: Mapped[str | None] = mapped_column(String(64))
    """Where the signal came from: NULL, the client; `history:<client>:<rule>`, the gateway's
    reading of the run's next request (`app.signals.history`)."""
