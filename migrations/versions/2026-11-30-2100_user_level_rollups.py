"""user-level rollups: per-user sums per experiment arm (whole and by day) and per user-day,
latency histograms per arm-day and user group, the ledger of counted rewards; trends per
checkpoint-hour

Revision ID: 0005_user_level_rollups
Revises: 0004_rewards_by_evidence
Create Date: 2026-11-30 21:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005_user_level_rollups"
down_revision: str | None = "0004_rewards_by_evidence"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COUNTS = (
    "requests",
    "fallback_requests",
    "errors",
    "edits_requested",
    "edits_proposed",
    "tool_call_responses",
    "malformed_responses",
    "final_rewards",
    "over_budget",
    "accept_observed",
    "accepted",
    "dissatisfied_observed",
    "dissatisfied",
    "kept_n",
    "reward_n",
)
TOTALS = ("kept_sum", "kept_sumsq", "reward_sum", "reward_sumsq", "latency_sum", "latency_sumsq")


def _metric_sums() -> list[sa.Column]:
    return [sa.Column(name, sa.BigInteger(), nullable=False) for name in COUNTS] + [
        sa.Column(name, sa.Float(), nullable=False) for name in TOTALS
    ]


def upgrade() -> None:
    # Derived data: the first refresh after this rebuilds everything from samples and rewards.
    op.execute("DELETE FROM rollup_state")
    op.drop_table("experiment_user_days")
    op.drop_table("experiment_users")
    op.drop_index("ix_hourly_rollups_hour", table_name="hourly_rollups")
    op.drop_index("ix_hourly_rollups_experiment_id_hour", table_name="hourly_rollups")
    op.drop_table("hourly_rollups")
    op.create_table(
        "hourly_rollups",
        sa.Column("hour", sa.DateTime(timezone=True), nullable=False),
        sa.Column("checkpoint", sa.String(length=64), nullable=False),
        *_metric_sums(),
        sa.PrimaryKeyConstraint("hour", "checkpoint", name=op.f("pk_hourly_rollups")),
    )
    op.create_table(
        "experiment_users",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.Column("first_served_at", sa.DateTime(timezone=True), nullable=False),
        *_metric_sums(),
        sa.PrimaryKeyConstraint(
            "experiment_id", "arm", "user_hash", name=op.f("pk_experiment_users")
        ),
    )
    op.create_table(
        "experiment_user_days",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        *_metric_sums(),
        sa.PrimaryKeyConstraint(
            "experiment_id", "arm", "day", "user_hash", name=op.f("pk_experiment_user_days")
        ),
    )
    op.create_table(
        "user_days",
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        *_metric_sums(),
        sa.PrimaryKeyConstraint("user_hash", "day", name=op.f("pk_user_days")),
    )
    op.create_table(
        "experiment_latency",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "experiment_id", "arm", "day", "bucket", name=op.f("pk_experiment_latency")
        ),
    )
    op.create_table(
        "experiment_latency_groups",
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("arm", sa.String(length=64), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("user_group", sa.Integer(), nullable=False),
        sa.Column("bucket", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint(
            "experiment_id",
            "arm",
            "day",
            "user_group",
            "bucket",
            name=op.f("pk_experiment_latency_groups"),
        ),
    )
    op.create_table(
        "rolled_up_rewards",
        sa.Column("sample_id", sa.BigInteger(), autoincrement=False, nullable=False),
        sa.Column("accepted", sa.Boolean(), nullable=True),
        sa.Column("dissatisfied", sa.Boolean(), nullable=True),
        sa.Column("over_budget", sa.Boolean(), nullable=False),
        sa.Column("kept", sa.Float(), nullable=True),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("sample_id", name=op.f("pk_rolled_up_rewards")),
    )


def downgrade() -> None:
    op.execute("DELETE FROM rollup_state")
    op.drop_table("rolled_up_rewards")
    op.drop_table("experiment_latency_groups")
    op.drop_table("experiment_latency")
    op.drop_table("user_days")
    op.drop_table("experiment_user_days")
    op.drop_table("experiment_users")
    op.drop_table("hourly_rollups")
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
        *[
            sa.Column(name, sa.BigInteger(), nullable=False)
            for name in COUNTS
            if name not in ("kept_n", "reward_n")
        ],
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
