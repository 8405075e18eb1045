"""rewards by evidence and agent runs: token counts, partitions, runs and sampling parameters
on samples; reopen counts on rewards

Revision ID: 0004_rewards_by_evidence
Revises: 0003_training_schedule
Create Date: 2026-11-30 20:10:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_rewards_by_evidence"
down_revision: str | None = "0003_training_schedule"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("samples", sa.Column("completion_tokens", sa.Integer(), nullable=True))
    op.add_column("samples", sa.Column("kafka_partition", sa.Integer(), nullable=True))
    op.add_column("samples", sa.Column("trajectory_id", sa.String(length=128), nullable=True))
    op.add_column(
        "samples", sa.Column("turn_index", sa.Integer(), server_default="0", nullable=False)
    )
    op.add_column("samples", sa.Column("parent_request_id", sa.String(length=128), nullable=True))
    op.add_column("samples", sa.Column("token_prefix_match", sa.Boolean(), nullable=True))
    op.add_column(
        "samples", sa.Column("temperature", sa.Float(), server_default="1", nullable=False)
    )
    op.add_column("samples", sa.Column("top_p", sa.Float(), server_default="1", nullable=False))
    op.add_column("samples", sa.Column("top_k", sa.Integer(), server_default="-1", nullable=False))
    op.add_column("samples", sa.Column("max_tokens", sa.Integer(), nullable=True))
    op.create_index(
        "ix_samples_trajectory_turn", "samples", ["trajectory_id", "turn_index"], unique=False
    )
    op.add_column(
        "rewards",
        sa.Column("reopen_count", sa.Integer(), server_default="0", nullable=False),
    )
    op.add_column(
        "rewards",
        sa.Column("late_evidence_count", sa.Integer(), server_default="0", nullable=False),
    )


def downgrade() -> None:
    op.drop_column("rewards", "late_evidence_count")
    op.drop_column("rewards", "reopen_count")
    op.drop_index("ix_samples_trajectory_turn", table_name="samples")
    for column in (
        "max_tokens",
        "top_k",
        "top_p",
        "temperature",
        "token_prefix_match",
        "parent_request_id",
        "turn_index",
        "trajectory_id",
    ):
        op.drop_column("samples", column)
    op.drop_column("samples", "kafka_partition")
    op.drop_column("samples", "completion_tokens")
