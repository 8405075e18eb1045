"""initial schema

Revision ID: 0001_initial_schema
Revises:
Create Date: 2026-11-29 17:08:25.983282
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_initial_schema"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute(sa.schema.CreateSequence(sa.Sequence("checkpoint_number_seq")))
    op.create_table(
        "alerts",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("checkpoint", sa.String(length=64), nullable=False),
        sa.Column("control_checkpoint", sa.String(length=64), nullable=False),
        sa.Column("metric", sa.String(length=64), nullable=False),
        sa.Column("canary_value", sa.Float(), nullable=False),
        sa.Column("control_value", sa.Float(), nullable=False),
        sa.Column("threshold", sa.Float(), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_alerts")),
    )
    op.create_index(
        "ix_alerts_checkpoint_created_at", "alerts", ["checkpoint", "created_at"], unique=False
    )
    op.create_table(
        "api_keys",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("key_prefix", sa.String(length=16), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column(
            "role",
            sa.Enum(
                "ide",
                "ops",
                "analyst",
                name="role",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("privacy_mode", sa.Boolean(), server_default="false", nullable=False),
        sa.Column("rate_limit_per_minute", sa.Integer(), nullable=True),
        sa.Column("created_by", sa.String(length=200), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("actor_key_id", sa.UUID(), nullable=True),
        sa.Column("action", sa.String(length=64), nullable=False),
        sa.Column("target", sa.String(length=200), nullable=False),
        sa.Column("before", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("after", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column(
            "at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_audit_log")),
    )
    op.create_index(op.f("ix_audit_log_at"), "audit_log", ["at"], unique=False)
    op.create_index("ix_audit_log_target_at", "audit_log", ["target", "at"], unique=False)
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("parent_id", sa.Integer(), nullable=True),
        sa.Column(
            "status",
            sa.Enum(
                "candidate",
                "canary",
                "production",
                "retired",
                "rolled_back",
                name="checkpoint_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("adapter_path", sa.Text(), nullable=True),
        sa.Column("reward_version", sa.Integer(), nullable=True),
        sa.Column("published_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("promoted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("retired_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"], ["checkpoints.id"], name=op.f("fk_checkpoints_parent_id_checkpoints")
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_checkpoints")),
        sa.UniqueConstraint("name", name=op.f("uq_checkpoints_name")),
    )
    op.create_index(op.f("ix_checkpoints_parent_id"), "checkpoints", ["parent_id"], unique=False)
    op.create_index(
        "uq_checkpoints_single_production",
        "checkpoints",
        ["status"],
        unique=True,
        postgresql_where=sa.text("status = 'production'"),
    )
    op.create_table(
        "control_flags",
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("value", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("updated_by", sa.String(length=200), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_control_flags")),
    )
    op.create_table(
        "experiments",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("route", sa.String(length=64), server_default="chat", nullable=False),
        sa.Column("salt", sa.String(length=64), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "draft",
                "running",
                "stopped",
                name="experiment_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("created_by", sa.String(length=200), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_experiments")),
        sa.UniqueConstraint("name", name=op.f("uq_experiments_name")),
    )
    op.create_index(
        "uq_experiments_running_route",
        "experiments",
        ["route"],
        unique=True,
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_table(
        "feedback_events",
        sa.Column("id", sa.BigInteger(), nullable=False),
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
        sa.PrimaryKeyConstraint("id", name=op.f("pk_feedback_events")),
        sa.UniqueConstraint("event_id", name=op.f("uq_feedback_events_event_id")),
    )
    op.create_index(
        "ix_feedback_events_request_id", "feedback_events", ["request_id"], unique=False
    )
    op.create_index(
        "ix_feedback_events_session_occurred_at",
        "feedback_events",
        ["session_id", "occurred_at"],
        unique=False,
    )
    op.create_table(
        "samples",
        sa.Column("id", sa.BigInteger(), nullable=False),
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
        sa.Column("tool_calls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("malformed_tool_calls", sa.Integer(), server_default="0", nullable=False),
        sa.Column("served_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_samples")),
        sa.UniqueConstraint("event_id", name=op.f("uq_samples_event_id")),
        sa.UniqueConstraint("request_id", name=op.f("uq_samples_request_id")),
    )
    op.create_index(
        "ix_samples_checkpoint_served_at", "samples", ["checkpoint", "served_at"], unique=False
    )
    op.create_index(
        "ix_samples_experiment_arm_served_at",
        "samples",
        ["experiment_id", "arm", "served_at"],
        unique=False,
    )
    op.create_index(
        "ix_samples_session_served_at", "samples", ["session_id", "served_at"], unique=False
    )
    op.create_table(
        "arms",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("experiment_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("checkpoint_id", sa.Integer(), nullable=False),
        sa.Column("weight_bps", sa.Integer(), nullable=False),
        sa.Column("is_control", sa.Boolean(), server_default="false", nullable=False),
        sa.CheckConstraint("weight_bps BETWEEN 0 AND 10000", name=op.f("ck_arms_weight_bps_range")),
        sa.ForeignKeyConstraint(
            ["checkpoint_id"], ["checkpoints.id"], name=op.f("fk_arms_checkpoint_id_checkpoints")
        ),
        sa.ForeignKeyConstraint(
            ["experiment_id"],
            ["experiments.id"],
            name=op.f("fk_arms_experiment_id_experiments"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_arms")),
        sa.UniqueConstraint("experiment_id", "name", name="uq_arms_experiment_id_name"),
    )
    op.create_index(op.f("ix_arms_checkpoint_id"), "arms", ["checkpoint_id"], unique=False)
    op.create_index(op.f("ix_arms_experiment_id"), "arms", ["experiment_id"], unique=False)
    op.create_table(
        "rewards",
        sa.Column("sample_id", sa.BigInteger(), nullable=False),
        sa.Column("components", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("reward", sa.Float(), nullable=True),
        sa.Column("reward_version", sa.Integer(), nullable=False),
        sa.Column("due_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finalized_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finalize_reason", sa.String(length=32), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["sample_id"],
            ["samples.id"],
            name=op.f("fk_rewards_sample_id_samples"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("sample_id", name=op.f("pk_rewards")),
    )
    op.create_index("ix_rewards_finalized_at", "rewards", ["finalized_at"], unique=False)
    op.create_index(
        "ix_rewards_open_due_at",
        "rewards",
        ["due_at"],
        unique=False,
        postgresql_where=sa.text("finalized_at IS NULL"),
    )
    op.create_table(
        "training_runs",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column(
            "status",
            sa.Enum(
                "running",
                "skipped",
                "refused",
                "rejected",
                "published",
                "failed",
                name="training_run_status",
                native_enum=False,
                create_constraint=True,
                length=16,
            ),
            nullable=False,
        ),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("config", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("stats", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("eval_results", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("base_checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("output_checkpoint_id", sa.Integer(), nullable=True),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=True),
        sa.Column("window_end", sa.DateTime(timezone=True), nullable=True),
        sa.Column("sample_count", sa.Integer(), server_default="0", nullable=False),
        sa.Column("run_name", sa.String(length=128), nullable=True),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(
            ["base_checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_training_runs_base_checkpoint_id_checkpoints"),
        ),
        sa.ForeignKeyConstraint(
            ["output_checkpoint_id"],
            ["checkpoints.id"],
            name=op.f("fk_training_runs_output_checkpoint_id_checkpoints"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_training_runs")),
    )
    op.create_index(
        op.f("ix_training_runs_output_checkpoint_id"),
        "training_runs",
        ["output_checkpoint_id"],
        unique=False,
    )
    op.create_index(op.f("ix_training_runs_status"), "training_runs", ["status"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_training_runs_status"), table_name="training_runs")
    op.drop_index(op.f("ix_training_runs_output_checkpoint_id"), table_name="training_runs")
    op.drop_table("training_runs")
    op.drop_index(
        "ix_rewards_open_due_at",
        table_name="rewards",
        postgresql_where=sa.text("finalized_at IS NULL"),
    )
    op.drop_index("ix_rewards_finalized_at", table_name="rewards")
    op.drop_table("rewards")
    op.drop_index(op.f("ix_arms_experiment_id"), table_name="arms")
    op.drop_index(op.f("ix_arms_checkpoint_id"), table_name="arms")
    op.drop_table("arms")
    op.drop_index("ix_samples_session_served_at", table_name="samples")
    op.drop_index("ix_samples_experiment_arm_served_at", table_name="samples")
    op.drop_index("ix_samples_checkpoint_served_at", table_name="samples")
    op.drop_table("samples")
    op.drop_index("ix_feedback_events_session_occurred_at", table_name="feedback_events")
    op.drop_index("ix_feedback_events_request_id", table_name="feedback_events")
    op.drop_table("feedback_events")
    op.drop_index(
        "uq_experiments_running_route",
        table_name="experiments",
        postgresql_where=sa.text("status = 'running'"),
    )
    op.drop_table("experiments")
    op.drop_table("control_flags")
    op.drop_index(
        "uq_checkpoints_single_production",
        table_name="checkpoints",
        postgresql_where=sa.text("status = 'production'"),
    )
    op.drop_index(op.f("ix_checkpoints_parent_id"), table_name="checkpoints")
    op.drop_table("checkpoints")
    op.drop_index("ix_audit_log_target_at", table_name="audit_log")
    op.drop_index(op.f("ix_audit_log_at"), table_name="audit_log")
    op.drop_table("audit_log")
    op.drop_table("api_keys")
    op.drop_index("ix_alerts_checkpoint_created_at", table_name="alerts")
    op.drop_table("alerts")
    op.execute(sa.schema.DropSequence(sa.Sequence("checkpoint_number_seq")))
