"""ttft measured: whether a sample's time to first token was measured (streamed, or timed by
vLLM) or is only its whole latency (a whole answer vLLM did not time)

Revision ID: 0007_ttft_measured
Revises: 0006_partitioned_history
Create Date: 2026-12-04 21:00:00

Rows written before it were all counted as measured, which is what their rewards charged.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_ttft_measured"
down_revision: str | None = "0006_partitioned_history"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On the partitioned table: every partition, present and future, gets the column.
    op.add_column(
        "samples",
        sa.Column("ttft_measured", sa.Boolean(), nullable=False, server_default=sa.true()),
    )


def downgrade() -> None:
    op.drop_column("samples", "ttft_measured")
