from __future__ import annotations

import enum
import uuid
from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Enum, Float, Index, String, Text, func
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
    """An IDE signal about a completion; may arrive before the completion itself."""

    __tablename__ = "feedback_events"
    __table_args__ = (
        Index("ix_feedback_events_request_id", "request_id"),
        Index("ix_feedback_events_session_occurred_at", "session_id", "occurred_at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False, unique=True)
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
    received_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), nullable=False
    )
