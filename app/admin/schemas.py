"""What ops send and read: checkpoints and lineage, experiments, keys, training, changes."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from app.models import CheckpointStatus, CycleTrigger, ExperimentStatus, Role, TrainingRunStatus


class CheckpointOut(BaseModel):
    name: str
    status: CheckpointStatus
    parent: str | None
    base_model: str
    adapter_path: str | None
    reward_version: int | None
    published_at: datetime | None
    promoted_at: datetime | None
    retired_at: datetime | None
    superseded_by: str | None
    """The newer candidate of the same parent whose canary replaced this one."""
    created_at: datetime


class TrainingRunOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    status: TrainingRunStatus
    reason: str | None
    run_name: str | None
    trigger: CycleTrigger | None
    """`schedule`, `request` (POST /admin/training/cycle) or `manual` (`rtrl train --once`)."""
    trainer: str | None
    """The trainer process that ran it, as host:pid."""
    base_checkpoint_id: int | None
    output_checkpoint_id: int | None
    sample_count: int
    window_start: datetime | None
    window_end: datetime | None
    started_at: datetime
    finished_at: datetime | None
    stats: dict[str, Any] | None
    eval_results: dict[str, Any] | None


class ArmOut(BaseModel):
    name: str
    checkpoint: str
    weight_bps: int
    is_control: bool


class ExperimentOut(BaseModel):
    id: int
    name: str
    route: str
    status: ExperimentStatus
    created_by: str | None
    created_at: datetime
    started_at: datetime | None
    stopped_at: datetime | None
    arms: list[ArmOut]


class Ramp(BaseModel):
    model_config = ConfigDict(extra="forbid")

    weights: dict[str, int] = Field(min_length=1, max_length=10)
    """Every arm's new weight in basis points, by arm name; they must sum to 10000."""


class Reason(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str | None = Field(default=None, max_length=500)
    """Why, for the audit log."""


class Promotion(Reason):
    override_alerts: bool = False
    """Promote even though the reward-hacking monitors raised alerts on the checkpoint
    (audited with the alerts' ids)."""


class ApiKeyOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: uuid.UUID
    name: str
    role: Role
    key_prefix: str
    privacy_mode: bool
    rate_limit_per_minute: int | None
    created_by: str | None
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None


class ApiKeyCreated(ApiKeyOut):
    secret: str
    """Shown this once; only its hash is stored."""


class TrainingState(BaseModel):
    paused: bool
    cycle_requested: bool
    next_cycle_at: datetime | None
    """When the next scheduled cycle is due (null before a trainer has started)."""
    recent_runs: list[TrainingRunOut]


class Change(BaseModel):
    """One audited change: who did what to which target, the state before and after."""

    model_config = ConfigDict(from_attributes=True)

    id: int
    actor: str
    actor_key_id: uuid.UUID | None
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    at: datetime


class CheckpointDetail(CheckpointOut):
    lineage: list[CheckpointOut]
    """This checkpoint, its parent, the parent's parent, ... up to the base model."""
    produced_by: list[TrainingRunOut]
    """The training run(s) that published it."""
    trained_from: list[TrainingRunOut]
    """Training runs that started from it."""
    experiments: list[ExperimentOut]
    audit: list[Change]
    """Changes to it and to its experiments, newest first (who stopped them, and why)."""


class UserErasure(BaseModel):
    model_config = ConfigDict(extra="forbid")

    user_id: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:@-]+$")
    """The user id as the IDE sends it (`X-User-Id`, or the API key's id when it sends
    none); hashed here exactly as the gateway hashes it."""
    reason: str | None = Field(default=None, max_length=500)
    """Why, for the audit log."""


class UserErased(BaseModel):
    """What an erasure removed; the audit entry records the same."""

    user_hash: str
    erased_at: datetime
    samples: int
    feedback_events: int
    rewards: int
    archived_samples: int
    archived_feedback_events: int
    archived_rewards: int
    archive_files_rewritten: int
    audit_id: int
