"""tools declared: whether a sample's request declared tools (agent traffic rather than
one-turn chat), a state the trainer's baseline is conditioned on

Revision ID: 0009_tools_declared
Revises: 0008_session_end_key
Create Date: 2026-12-05 07:30:00

Rows written before it read as declaring none: in a batch that still holds them, agent turns
share the one-turn strata, kept apart by turn and edit request only.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_tools_declared"
down_revision: str | None = "0008_session_end_key"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # On the partitioned table: every partition, present and future, gets the column.
    op.add_column(
        "samples",
        sa.Column("tools_declared", sa.Boolean(), nullable=False, server_default=sa.false()),
    )


def downgrade() -> None:
    op.drop_column("samples", "tools_declared")
