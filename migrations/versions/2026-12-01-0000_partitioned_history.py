"""partitioned history: samples, feedback_events and rewards partitioned by day (each with a
default partition), rewards carry their sample's served_at, samples are indexed by user;
erased users and sessions

Revision ID: 0006_partitioned_history
Revises: 0005_user_level_rollups
Create Date: 2026-12-01 00:00:00

Postgres cannot turn a table into a partitioned one in place: each table is rebuilt under
its own name, its rows copied into a partition per day they cover, and the old one dropped.
Downgrading rebuilds the plain tables the same way.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0006_partitioned_history"
down_revision: str | None = "0005_user_level_rollups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Table -> its partition key.
PARTITION_KEYS = {"samples": "served_at", "feedback_events": "occurred_at", "rewards": "served_at"}

SAMPLE_COLUMNS = (
    "id, event_id, request_id, session_id, user_hash, api_key_id, checkpoint, experiment_id, "
    "arm, fallback, privacy, trainable, edit_requested, proposed_edit, clarifying_question, "
    "prompt_messages, prompt_token_ids, completion_token_ids, behaviour_logprobs, "
    "completion_text, completion_chars, finish_reason, status, ttft_ms, latency_ms, "
    "completion_tokens, trajectory_id, turn_index, parent_request_id, token_prefix_match, "
    "temperature, top_p, top_k, max_tokens, kafka_partition, tool_calls, malformed_tool_calls, "
    "served_at, created_at"
)
FEEDBACK_COLUMNS = (
    "id, event_id, request_id, session_id, kind, elapsed_s, surviving_share, message, "
    "dissatisfied, occurred_at, received_at"
)
REWARD_COLUMNS = (
    "sample_id, components, reward, reward_version, due_at, finalized_at, finalize_reason, "
    "reopen_count, late_evidence_count, updated_at"
)

INDEXES = {
    "samples": (
        "ix_samples_checkpoint_served_at",
        "ix_samples_experiment_arm_served_at",
        "ix_samples_session_served_at",
        "ix_samples_trajectory_turn",
        "ix_samples_created_at_brin",
        "ix_samples_served_at_brin",
    ),
    "feedback_events": ("ix_feedback_events_request_id", "ix_feedback_events_session_occurred_at"),
    "rewards": ("ix_rewards_open_due_at", "ix_rewards_finalized_at", "ix_rewards_updated_at_brin"),
}
CONSTRAINTS = {
    "samples": ("pk_samples", "uq_samples_event_id", "uq_samples_request_id"),
    "feedback_events": ("pk_feedback_events", "uq_feedback_events_event_id"),
    "rewards": ("pk_rewards",),
}


def upgrade() -> None:
    _set_aside(partitioned=False)
    _create_samples(partitioned=True)
    _create_feedback_events(partitioned=True)
    _create_rewards(partitioned=True)
    for table, key in PARTITION_KEYS.items():
        op.execute(f"CREATE TABLE {table}_default PARTITION OF {table} DEFAULT")
        _partitions_for_old_days(table, key)
    _copy_back(rewards_served_at=True)
    op.create_foreign_key(
        "fk_rewards_sample_id_samples",
        "rewards",
        "samples",
        ["sample_id", "served_at"],
        ["id", "served_at"],
        ondelete="CASCADE",
    )
    op.create_table(
        "erased_users",
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("user_hash", name=op.f("pk_erased_users")),
    )
    op.create_table(
        "erased_sessions",
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.Column("erased_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("session_id", name=op.f("pk_erased_sessions")),
    )
    op.create_index(
        op.f("ix_erased_sessions_user_hash"), "erased_sessions", ["user_hash"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_erased_sessions_user_hash"), table_name="erased_sessions")
    op.drop_table("erased_sessions")
    op.drop_table("erased_users")
    _set_aside(partitioned=True)
    _create_samples(partitioned=False)
    _create_feedback_events(partitioned=False)
    _create_rewards(partitioned=False)
    _copy_back(rewards_served_at=False)
    op.create_foreign_key(
        "fk_rewards_sample_id_samples",
        "rewards",
        "samples",
        ["sample_id"],
        ["id"],
        ondelete="CASCADE",
    )


def _set_aside(*, partitioned: bool) -> None:
    """Rename the three tables to `<name>_old` and free their index, key and sequence names."""
    op.drop_constraint("fk_rewards_sample_id_samples", "rewards", type_="foreignkey")
    for table in PARTITION_KEYS:
        op.execute(f"ALTER TABLE {table} RENAME TO {table}_old")
        indexes = INDEXES[table] + (
            ("ix_samples_user_hash",) if partitioned and table == "samples" else ()
        )
        for index in indexes:
            op.execute(f"DROP INDEX {index}")
        for constraint in CONSTRAINTS[table]:
            op.execute(f"ALTER TABLE {table}_old DROP CONSTRAINT {constraint}")
    for table in ("samples", "feedback_events"):
        op.execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY NONE")


def _partitions_for_old_days(table: str, key: str) -> None:
    """A partition for every UTC day the old table has rows of, so none lands in the default."""
    source = "samples_old" if table == "rewards" else f"{table}_old"
    days = op.get_bind().execute(
        sa.text(
            f"SELECT DISTINCT date_trunc('day', {key}, 'UTC') AS day FROM {source} ORDER BY day"
        )
    )
    for (day,) in days:
        op.execute(
            f"CREATE TABLE {table}_p{day:%Y%m%d} PARTITION OF {table} "
            f"FOR VALUES FROM ('{day.isoformat()}') TO ('{day.isoformat()}'::timestamptz "
            "+ interval '1 day')"
        )


def _copy_back(*, rewards_served_at: bool) -> None:
    op.execute(f"INSERT INTO samples ({SAMPLE_COLUMNS}) SELECT {SAMPLE_COLUMNS} FROM samples_old")
    op.execute(
        f"INSERT INTO feedback_events ({FEEDBACK_COLUMNS}) "
        f"SELECT {FEEDBACK_COLUMNS} FROM feedback_events_old"
    )
    if rewards_served_at:
        op.execute(
            f"INSERT INTO rewards ({REWARD_COLUMNS}, served_at) "
            f"SELECT {', '.join('r.' + c.strip() for c in REWARD_COLUMNS.split(','))}, s.served_at "
            "FROM rewards_old r JOIN samples_old s ON s.id = r.sample_id"
        )
    else:
        op.execute(
            f"INSERT INTO rewards ({REWARD_COLUMNS}) SELECT {REWARD_COLUMNS} FROM rewards_old"
        )
    for table in PARTITION_KEYS:
        op.execute(f"DROP TABLE {table}_old CASCADE")
    for table in ("samples", "feedback_events"):
        op.execute(f"ALTER SEQUENCE {table}_id_seq OWNED BY {table}.id")


def _partitioning(partitioned: bool, key: str) -> dict[str, str]:
    return {"postgresql_partition_by": f"RANGE ({key})"} if partitioned else {}


def _create_samples(*, partitioned: bool) -> None:
    keys = ("id", "served_at") if partitioned else ("id",)
    unique = ("served_at",) if partitioned else ()
    op.create_table(
        "samples",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('samples_id_seq'::regclass)"),
            nullable=False,
        ),
        sa.Column("event_id", sa.UUID(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column("user_hash", sa.String(length=64), nullable=False),
        sa.Column("api_key_id", sa.UUID(), nullable=True),
        sa.Column("checkpoint", sa.String(length=64), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=True),
        sa.Column("arm", sa.String(length=64), nullable=True),
        sa.Column("fallback", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("privacy", sa.Boolean(), nullable=False),
        sa.Column("trainable", sa.Boolean(), nullable=False),
        sa.Column("edit_requested", sa.Boolean(), nullable=False),
        sa.Column("proposed_edit", sa.Boolean(), nullable=False),
        sa.Column("clarifying_question", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("prompt_messages", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("prompt_token_ids", postgresql.ARRAY(sa.Integer()), nullable=True),
        sa.Column("completion_token_ids", postgresql.ARRAY(sa.Integer()), nullable=True),
        sa.Column("behaviour_logprobs", postgresql.ARRAY(sa.Float()), nullable=True),
        sa.Column("completion_text", sa.Text(), nullable=True),
        sa.Column("completion_chars", sa.Integer(), server_default="0", nullable=False),
        sa.Column("finish_reason", sa.String(length=32), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=False),
        sa.Column("latency_ms", sa.Float(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("trajectory_id", sa.String(length=128), nullable=True),
        sa.Column("turn_index", sa.Integer(), server_default="0", nullable=False),
        sa.Column("parent_request_id", sa.String(length=128), nullable=True),
        sa.Column("token_prefix_match", sa.Boolean(), nullable=True),
        sa.Column("temperature", sa.Float(), server_default="1", nullable=False),
        sa.Column("top_p", sa.Float(), server_default="1", nullable=False),
        sa.Column("top_k", sa.Integer(), server_default="-1", nullable=False),
        sa.Column("max_tokens", sa.Integer(), nullable=True),
        sa.Column("kafka_partition", sa.Integer(), nullable=True),
        sa.Column("tool_calls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("malformed_tool_calls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(*keys, name=op.f("pk_samples")),
        sa.UniqueConstraint("event_id", *unique, name="uq_samples_event_id"),
        sa.UniqueConstraint("request_id", *unique, name="uq_samples_request_id"),
        **_partitioning(partitioned, "served_at"),
    )
    op.create_index("ix_samples_checkpoint_served_at", "samples", ["checkpoint", "served_at"])
    op.create_index(
        "ix_samples_experiment_arm_served_at", "samples", ["experiment_id", "arm", "served_at"]
    )
    op.create_index("ix_samples_session_served_at", "samples", ["session_id", "served_at"])
    op.create_index("ix_samples_trajectory_turn", "samples", ["trajectory_id", "turn_index"])
    if partitioned:
        op.create_index("ix_samples_user_hash", "samples", ["user_hash"])
    op.create_index(
        "ix_samples_created_at_brin", "samples", ["created_at"], postgresql_using="brin"
    )
    op.create_index("ix_samples_served_at_brin", "samples", ["served_at"], postgresql_using="brin")


def _create_feedback_events(*, partitioned: bool) -> None:
    keys = ("id", "occurred_at") if partitioned else ("id",)
    unique = ("occurred_at",) if partitioned else ()
    op.create_table(
        "feedback_events",
        sa.Column(
            "id",
            sa.BigInteger(),
            server_default=sa.text("nextval('feedback_events_id_seq'::regclass)"),
            nullable=False,
        ),
        sa.Column("event_id", sa.UUID(), nullable=False),
        sa.Column("request_id", sa.String(length=128), nullable=False),
        sa.Column("session_id", sa.String(length=128), nullable=False),
        sa.Column(
            "kind",
            sa.Enum(
                "edit_accepted",
                "edit_rejected",
                "edit_survival",
                "followup_message",
                "session_end",
                name="feedback_kind",
                native_enum=False,
                create_constraint=True,
                length=32,
            ),
            nullable=False,
        ),
        sa.Column("elapsed_s", sa.Float(), nullable=True),
        sa.Column("surviving_share", sa.Float(), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("dissatisfied", sa.Boolean(), nullable=True),
        sa.Column("occurred_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "received_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(*keys, name=op.f("pk_feedback_events")),
        sa.UniqueConstraint("event_id", *unique, name="uq_feedback_events_event_id"),
        **_partitioning(partitioned, "occurred_at"),
    )
    op.create_index("ix_feedback_events_request_id", "feedback_events", ["request_id"])
    op.create_index(
        "ix_feedback_events_session_occurred_at", "feedback_events", ["session_id", "occurred_at"]
    )


def _create_rewards(*, partitioned: bool) -> None:
    served_at = (
        [sa.Column("served_at", sa.DateTime(timezone=True), nullable=False)] if partitioned else []
    )
    keys = ("sample_id", "served_at") if partitioned else ("sample_id",)
    op.create_table(
        "rewards",
        sa.Column("sample_id", sa.BigInteger(), nullable=False),
        *served_at,
        sa.Column("components", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("reward_version", sa.Integer(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalize_reason", sa.String(length=32), nullable=True),
        sa.Column("reopen_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("late_evidence_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint(*keys, name=op.f("pk_rewards")),
        **_partitioning(partitioned, "served_at"),
    )
    op.create_index(
        "ix_rewards_open_due_at",
        "rewards",
        ["due_at"],
        postgresql_where=sa.text("finalized_at IS NULL"),
    )
    op.create_index("ix_rewards_finalized_at", "rewards", ["finalized_at"])
    op.create_index(
        "ix_rewards_updated_at_brin", "rewards", ["updated_at"], postgresql_using="brin"
    )
