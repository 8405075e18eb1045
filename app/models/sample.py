from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    Index,
    Integer,
    PrimaryKeyConstraint,
    String,
    Text,
    UniqueConstraint,
    true,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, CreatedAt


class Sample(CreatedAt, Base):
    """One served completion: what the policy saw, produced and how fast.

    Partitioned by day of `served_at` (`app.history.partitions`): every key includes it, and
    it is the same for every delivery of the completion's event, so a redelivery still
    conflicts with the row it already made.
    """

    __tablename__ = "samples"
    __table_args__ = (
        PrimaryKeyConstraint("id", "served_at"),
        UniqueConstraint("event_id", "served_at", name="uq_samples_event_id"),
        UniqueConstraint("request_id", "served_at", name="uq_samples_request_id"),
        Index("ix_samples_checkpoint_served_at", "checkpoint", "served_at"),
        Index("ix_samples_experiment_arm_served_at", "experiment_id", "arm", "served_at"),
        Index("ix_samples_session_served_at", "session_id", "served_at"),
        Index("ix_samples_trajectory_turn", "trajectory_id", "turn_index"),
        # Erasure finds a user's samples without reading every partition.
        Index("ix_samples_user_hash", "user_hash"),
        # Block-range indexes for the analytics rollup: which hours changed, and their rows.
        Index("ix_samples_created_at_brin", "created_at", postgresql_using="brin"),
        Index("ix_samples_served_at_brin", "served_at", postgresql_using="brin"),
        {"postgresql_partition_by": "RANGE (served_at)"},
    )

    id: Mapped[int] = mapped_column(BigInteger, autoincrement=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    session_id: Mapped[str] = mapped_column(String(128), nullable=False)
    user_hash: Mapped[str] = mapped_column(String(64), nullable=False)
    api_key_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    checkpoint: Mapped[str] = mapped_column(String(64), nullable=False)
    experiment_id: Mapped[int | None] = mapped_column(Integer)
    arm: Mapped[str | None] = mapped_column(String(64))
    fallback: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    privacy: Mapped[bool] = mapped_column(Boolean, nullable=False)
    trainable: Mapped[bool] = mapped_column(Boolean, nullable=False)
    edit_requested: Mapped[bool] = mapped_column(Boolean, nullable=False)
    tools_declared: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default="false")
    """The request declared tools (agent traffic); part of the state the trainer's baseline
    is conditioned on."""
    side_request: Mapped[str | None] = mapped_column(String(32))
    """What the client asked besides its turns (a title, a commit message, ...; None for an
    agent or chat turn): never trainable (`app.signals.side_requests`)."""
    proposed_edit: Mapped[bool] = mapped_column(Boolean, nullable=False)
    clarifying_question: Mapped[bool] = mapped_column(
        Boolean, nullable=False, server_default="false"
    )
    prompt_messages: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    prompt_token_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    completion_token_ids: Mapped[list[int] | None] = mapped_column(ARRAY(Integer))
    behaviour_logprobs: Mapped[list[float] | None] = mapped_column(ARRAY(Float))
    completion_text: Mapped[str | None] = mapped_column(Text)
    completion_chars: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    finish_reason: Mapped[str | None] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), nullable=False)
    ttft_ms: Mapped[float] = mapped_column(Float, nullable=False)
    ttft_measured: Mapped[bool] = mapped_column(Boolean, nullable=False, server_default=true())
    """False: a whole answer vLLM did not time; `ttft_ms` is then its whole latency."""
    latency_ms: Mapped[float] = mapped_column(Float, nullable=False)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    trajectory_id: Mapped[str | None] = mapped_column(String(128))
    """The agent run (the request id of its first turn)."""
    turn_index: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    parent_request_id: Mapped[str | None] = mapped_column(String(128))
    token_prefix_match: Mapped[bool | None] = mapped_column(Boolean)
    temperature: Mapped[float] = mapped_column(Float, nullable=False, server_default="1")
    top_p: Mapped[float] = mapped_column(Float, nullable=False, server_default="1")
    top_k: Mapped[int] = mapped_column(Integer, nullable=False, server_default="-1")
    max_tokens: Mapped[int | None] = mapped_column(Integer)
    kafka_partition: Mapped[int | None] = mapped_column(Integer)
    """The partition its events travel on: the sweep finalizes a partition by its own stream."""
    tool_calls: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    malformed_tool_calls: Mapped[int] = mapped_column(Integer, nullable=False, server_default="0")
    served_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
