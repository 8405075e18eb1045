"""side request: what a client asked besides its turns (a title, a commit message, a summary,
a suggestion, memories), on each sample; such samples are never trainable

Revision ID: 0012_side_request
Revises: 0011_feedback_source
Create Date: 2026-12-07 12:30:00

Rows written before it read as turns: side requests were not told apart then.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_side_request"
down_revision: str | None = "0011_feedback_source"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On the partitioned table: every partition, present and future, gets the column.
    op.add_column("samples", sa.Column("side_request", sa.String(32), nullable=True))


def downgrade() -> None:
    op.drop_column("samples", "side_request")
