"""analytics rollups: hourly sums per checkpoint and arm, users per arm, change indexes

Revision ID: 0002_analytics_rollups
Revises: 0001_initial_schema
Create Date: 2026-11-29 18:28:17.467845
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002_analytics_rollups"
down_revision: str | None = "0001_initial_schema"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "experiment_user_days",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint(
            "experiment_id", "arm", "day", "user_hash", name=op.f("pk_experiment_user_days")
        ),
    )
    op.create_table(
        "experiment_users",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint(
            "experiment_id", "arm", "user_hash", name=op.f("pk_experiment_users")
        ),
    )
    op.create_table(
        "hourly_rollups",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checkpoint", sa.String(length=64), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("arm", sa.String(length=64), nullable=True),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("fallback_requests", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("edits_requested", sa.BigInteger(), nullable=False),
        sa.Column("edits_proposed", sa.BigInteger(), nullable=False),
        sa.Column("tool_call_responses", sa.BigInteger(), nullable=False),
        sa.Column("malformed_responses", sa.BigInteger(), nullable=False),
        sa.Column("final_rewards", sa.BigInteger(), nullable=False),
        sa.Column("over_budget", sa.BigInteger(), nullable=False),
        sa.Column("accept_observed", sa.BigInteger(), nullable=False),
        sa.Column("accepted", sa.BigInteger(), nullable=False),
        sa.Column("dissatisfied_observed", sa.BigInteger(), nullable=False),
        sa.Column("dissatisfied", sa.BigInteger(), nullable=False),
        sa.Column("kept_n", sa.BigInteger(), nullable=False),
        sa.Column("kept_sum", sa.Float(), nullable=False),
        sa.Column("kept_sumsq", sa.Float(), nullable=False),
        sa.Column("reward_n", sa.BigInteger(), nullable=False),
        sa.Column("reward_sum", sa.Float(), nullable=False),
        sa.Column("reward_sumsq", sa.Float(), nullable=False),
        sa.Column("latency_sum", sa.Float(), nullable=False),
        sa.Column("latency_sumsq", sa.Float(), nullable=False),
        sa.Column("latency_buckets", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.Column("latency_counts", postgresql.ARRAY(sa.Integer()), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_hourly_rollups")),
    )
    op.create_index(
        "ix_hourly_rollups_experiment_id_hour",
        "hourly_rollups",
        ["experiment_id", "hour"],
        unique=False,
    )
    op.create_index("ix_hourly_rollups_hour", "hourly_rollups", ["hour"], unique=False)
    op.create_table(
        "rollup_state",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("watermark", sa.DateTime(timezone=True), nullable=False),
        sa.Column("refreshed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_rollup_state")),
    )
    op.create_index(
        "ix_rewards_updated_at_brin",
        "rewards",
        ["updated_at"],
        unique=False,
        postgresql_using="brin",
    )
    op.create_index(
        "ix_samples_created_at_brin",
        "samples",
        ["created_at"],
        unique=False,
        postgresql_using="brin",
    )
    op.create_index(
        "ix_samples_served_at_brin", "samples", ["served_at"], unique=False, postgresql_using="brin"
    )


def downgrade() -> None:
    op.drop_index("ix_samples_served_at_brin", table_name="samples", postgresql_using="brin")
    op.drop_index("ix_samples_created_at_brin", table_name="samples", postgresql_using="brin")
    op.drop_index("ix_rewards_updated_at_brin", table_name="rewards", postgresql_using="brin")
    op.drop_table("rollup_state")
    op.drop_index("ix_hourly_rollups_hour", table_name="hourly_rollups")
    op.drop_index("ix_hourly_rollups_experiment_id_hour", table_name="hourly_rollups")
    op.drop_table("hourly_rollups")
    op.drop_table("experiment_users")
    op.drop_table("experiment_user_days")
