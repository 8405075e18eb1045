"""session end key: a `session_end` records the API key that ended the session, which alone
it finalizes

Revision ID: 0008_session_end_key
Revises: 0007_ttft_measured
Create Date: 2026-12-04 21:30:00

Ends stored before it have none, and end every completion of their session as they did.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_session_end_key"
down_revision: str | None = "0007_ttft_measured"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("feedback_events", sa.Column("api_key_id", postgresql.UUID(), nullable=True))


def downgrade() -> None:
    op.drop_column("feedback_events", "api_key_id")
