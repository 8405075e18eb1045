"""training schedule: the next due cycle per route, what started each run, superseded canaries

Revision ID: 0003_training_schedule
Revises: 0002_analytics_rollups
Create Date: 2026-11-30 20:00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_training_schedule"
down_revision: str | None = "0002_analytics_rollups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "training_schedule",
        sa.Column("route", sa.String(length=64), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("route", name=op.f("pk_training_schedule")),
    )
    op.add_column(
        "training_runs",
        sa.Column(
            "trigger",
            sa.Enum(
                "schedule",
                "request",
                "manual",
                name="cycle_trigger",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=True,
        ),
    )
    op.add_column("training_runs", sa.Column("trainer", sa.String(length=200), nullable=True))
    op.add_column("checkpoints", sa.Column("superseded_by_id", sa.Integer(), nullable=True))
    op.create_foreign_key(
        op.f("fk_checkpoints_superseded_by_id_checkpoints"),
        "checkpoints",
        "checkpoints",
        ["superseded_by_id"],
        ["id"],
    )


def downgrade() -> None:
    op.drop_constraint(
        op.f("fk_checkpoints_superseded_by_id_checkpoints"), "checkpoints", type_="foreignkey"
    )
    op.drop_column("checkpoints", "superseded_by_id")
    op.drop_column("training_runs", "trainer")
    op.drop_column("training_runs", "trigger")
    op.drop_table("training_schedule")
