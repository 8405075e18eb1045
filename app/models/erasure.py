from __future__ import annotations

from datetime import datetime

from sqlalchemy import DateTime, String
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base


class ErasedUser(Base):
    """A user whose data was erased: what was served to them before `erased_at` is never
    stored or trained on again (a redelivered event, a training cycle in flight)."""

    __tablename__ = "erased_users"

    user_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    erased_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)


class ErasedSession(Base):
    """A session of an erased user: its feedback is refused whenever it arrives, since a
    feedback event names its session, not its user."""

    __tablename__ = "erased_sessions"

    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False, index=True)
    erased_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
