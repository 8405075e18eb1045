"""censored edits in the rollups: of the final rewards of answers that proposed an edit, how
many edits' fate was never seen (the `censored_edit_rate` metric)

Revision ID: 0013_censored_edits
Revises: 0012_side_request
Create Date: 2026-12-07 21:00:00

The rollups are derived: the watermark is dropped, so the next refresh rebuilds them from
`samples` and `rewards`, the new sums included.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_censored_edits"
down_revision: str | None = "0012_side_request"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TABLES = ("hourly_rollups", "experiment_users", "experiment_user_days", "user_days")
COLUMNS = ("edits_final", "edits_censored")


def upgrade() -> None:
    for table in TABLES:
        for column in COLUMNS:
            op.add_column(
                table, sa.Column(column, sa.BigInteger(), nullable=False, server_default="0")
            )
    op.execute("DELETE FROM rollup_state")


def downgrade() -> None:
    for table in TABLES:
        for column in COLUMNS:
            op.drop_column(table, column)
    op.execute("DELETE FROM rollup_state")
