"""training run prediction: a candidate's A/B as predicted from production's logged samples
before its canary (off-policy), with its diagnostics

Revision ID: 0010_training_run_prediction
Revises: 0009_tools_declared
Create Date: 2026-12-05 08:00:00

Runs recorded before it have none.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0010_training_run_prediction"
down_revision: str | None = "0009_tools_declared"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("training_runs", sa.Column("prediction", postgresql.JSONB(), nullable=True))


def downgrade() -> None:
    op.drop_column("training_runs", "prediction")
