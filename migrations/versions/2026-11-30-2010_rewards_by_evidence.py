"""rewards by evidence: token counts and partitions on samples, reopen counts on rewards

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
    op.drop_column("samples", "kafka_partition")
    op.drop_column("samples", "completion_tokens")
