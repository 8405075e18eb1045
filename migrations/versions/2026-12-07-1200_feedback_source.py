"""feedback source: where an IDE signal came from, the client (NULL) or the gateway's reading
of the run's next request (`history:<client>:<rule>`)

Revision ID: 0011_feedback_source
Revises: 0010_training_run_prediction
Create Date: 2026-12-07 12:00:00

Rows written before it read as the client's: every signal was then.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_feedback_source"
down_revision: str | None = "0010_training_run_prediction"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On the partitioned table: every partition, present and future, gets the column.
    op.add_column("feedback_events", sa.Column("source", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("feedback_events", "source")
