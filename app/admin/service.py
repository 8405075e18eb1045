"""What ops change: which checkpoint serves, experiments, API keys, the trainer's switches.

Each change runs in the caller's transaction under one advisory lock (so two changes to
routing never interleave), refuses invalid transitions with an `AdminError`, and writes an
audit entry (who, what, before, after) beside the change. The caller commits, then tells
every gateway to reload its routing table.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, literal, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from app.admin.schemas import ApiKeyCreate
from app.auth.service import create_api_key
from app.models import (
    ApiKey,
    Arm,
    AuditEntry,
    Checkpoint,
    CheckpointStatus,
    ControlFlag,
    Experiment,
    ExperimentStatus,
    TrainingRun,
)
from app.serving.replicas import ReplicaError, load_adapter, served_adapters

ROUTING_LOCK = {"namespace": 0x7274726C, "key": -2}
# The trainer's control flags (trainer/scheduler.py reads them; importing it loads torch).
TRAINING_PAUSED = "training_paused"
CYCLE_REQUESTED = "training_cycle_requested"
OPEN_EXPERIMENTS = (ExperimentStatus.draft, ExperimentStatus.running)


class AdminError(Exception):
    """A refused change: 404 unknown target, 409 invalid transition, 422 invalid values."""

    def __init__(
        self, status_code: int, code: str, message: str, *, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.code = code
        self.message = message
        self.param = param


@dataclass(frozen=True)
class Actor:
    """Who makes a change: an API key (name and id), or an automatic process by name."""

    name: str
    key_id: uuid.UUID | None = None


def lock_routing(session: Session) -> None:
    """Serialise changes to routing until the transaction ends."""
    session.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ROUTING_LOCK)


def audit(
    session: Session | AsyncSession,
    actor: Actor,
    action: str,
    target: str,
    before: dict[str, Any] | None,
    after: dict[str, Any] | None,
) -> AuditEntry:
    """Record a change in the audit log, in the same transaction as the change."""
    entry = AuditEntry(
        actor=actor.name,
        actor_key_id=actor.key_id,
        action=action,
        target=target,
        before=before,
        after=after,
    )
    session.add(entry)
    return entry


# -- checkpoints ---------------------------------------------------------------------------


def checkpoint_named(session: Session, name: str, *, lock: bool = False) -> Checkpoint:
    query = select(Checkpoint).where(Checkpoint.name == name)
    checkpoint = session.scalar(query.with_for_update() if lock else query)
    if checkpoint is None:
        raise AdminError(404, "checkpoint_not_found", f"Checkpoint {name!r} does not exist.")
    return checkpoint


def list_checkpoints(session: Session, status: CheckpointStatus | None) -> list[Checkpoint]:
    query = select(Checkpoint).order_by(Checkpoint.id.desc())
    if status is not None:
        query = query.where(Checkpoint.status == status)
    return list(session.scalars(query))


def lineage(session: Session, checkpoint: Checkpoint) -> list[Checkpoint]:
    """The checkpoint, its parent, the parent's parent, ... (a recursive query)."""
    chain = (
        select(Checkpoint.id, Checkpoint.parent_id, literal(0).label("depth"))
        .where(Checkpoint.id == checkpoint.id)
        .cte("chain", recursive=True)
    )
    chain = chain.union_all(
        select(Checkpoint.id, Checkpoint.parent_id, (chain.c.depth + 1).label("depth"))
        .join(chain, Checkpoint.id == chain.c.parent_id)
        .where(chain.c.depth < 10_000)
    )
    query = select(Checkpoint).join(chain, Checkpoint.id == chain.c.id).order_by(chain.c.depth)
    return list(session.scalars(query))


def training_runs_of(session: Session, checkpoint: Checkpoint) -> tuple[list[Any], list[Any]]:
    """The runs that produced the checkpoint, and the runs that started from it."""
    produced = session.scalars(
        select(TrainingRun)
        .where(TrainingRun.output_checkpoint_id == checkpoint.id)
        .order_by(TrainingRun.id)
    )
    trained = session.scalars(
        select(TrainingRun)
        .where(TrainingRun.base_checkpoint_id == checkpoint.id)
        .order_by(TrainingRun.id.desc())
        .limit(50)
    )
    return list(produced), list(trained)


def recent_training_runs(session: Session, limit: int) -> list[TrainingRun]:
    return list(session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc()).limit(limit)))


def checkpoint_names(session: Session, ids: Iterable[int] | None = None) -> dict[int, str]:
    query = select(Checkpoint.id, Checkpoint.name)
    if ids is not None:
        query = query.where(Checkpoint.id.in_(list(ids)))
    return {row.id: row.name for row in session.execute(query)}


def serve_everywhere(name: str, adapter_path: str | None, replicas: Sequence[str]) -> list[str]:
    """Load the adapter into every replica that lacks it; the failures, one line each.

    Blocking HTTP: call it from a worker thread.
    """
    if adapter_path is None:
        return []  # the base model is always served
    failures = []
    for replica in replicas:
        try:
            if name not in served_adapters(replica):
                load_adapter(replica, name, Path(adapter_path))
        except ReplicaError as exc:
            failures.append(str(exc))
    return failures


def _checkpoint_state(checkpoint: Checkpoint | None) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    return {"name": checkpoint.name, "status": checkpoint.status.value}


def _production(session: Session) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production).with_for_update()
    )


def promote(session: Session, name: str, actor: Actor, reason: str | None = None) -> AuditEntry:
    """Make a candidate or canary the production checkpoint; the previous one is retired.

    The previous production stays `retired` (not `rolled_back`), so a rollback can return
    to it. Running experiments that involve either checkpoint are stopped: their control
    no longer is production.
    """
    lock_routing(session)
    checkpoint = checkpoint_named(session, name, lock=True)
    if checkpoint.status == CheckpointStatus.production:
        raise AdminError(409, "already_production", f"{name} is already production.")
    if checkpoint.status not in (CheckpointStatus.candidate, CheckpointStatus.canary):
        raise AdminError(
            409,
            "not_promotable",
            f"{name} is {checkpoint.status.value}; only a candidate or canary can be promoted "
            "(to return to an earlier production, roll back).",
        )
    previous = _production(session)
    before = {
        "production": previous.name if previous else None,
        "checkpoint": _checkpoint_state(checkpoint),
    }
    now = datetime.now(UTC)
    if previous is not None:
        previous.status = CheckpointStatus.retired
        previous.retired_at = now
        session.flush()  # the partial unique index admits one production at a time
    checkpoint.status = CheckpointStatus.production
    checkpoint.promoted_at = now
    checkpoint.retired_at = None
    involved = [checkpoint.id] + ([previous.id] if previous else [])
    stopped = _stop_experiments_with(session, involved, now)
    session.flush()
    return audit(
        session,
        actor,
        "checkpoint.promote",
        f"checkpoint:{name}",
        before,
        {
            "production": name,
            "retired": previous.name if previous else None,
            "stopped_experiments": stopped,
            "reason": reason,
        },
    )


def rollback(session: Session, name: str, actor: Actor, reason: str | None = None) -> AuditEntry:
    """Roll back production (to the previous production) or a canary (stop its experiment)."""
    lock_routing(session)
    checkpoint = checkpoint_named(session, name, lock=True)
    if checkpoint.status == CheckpointStatus.production:
        return rollback_production(session, actor, reason)
    if checkpoint.status in (CheckpointStatus.canary, CheckpointStatus.candidate):
        return rollback_canary(session, name, actor, reason)
    raise AdminError(
        409,
        "not_live",
        f"{name} is {checkpoint.status.value}; only production, a canary or a candidate "
        "can be rolled back.",
    )


def rollback_production(session: Session, actor: Actor, reason: str | None = None) -> AuditEntry:
    """Production becomes `rolled_back`; the most recently retired production serves again."""
    lock_routing(session)
    current = _production(session)
    if current is None:
        raise AdminError(409, "no_production", "No checkpoint is production.")
    restored = session.scalar(
        select(Checkpoint)
        .where(
            Checkpoint.status == CheckpointStatus.retired,
            Checkpoint.promoted_at.is_not(None),
            Checkpoint.id != current.id,
        )
        .order_by(Checkpoint.retired_at.desc().nulls_last(), Checkpoint.id.desc())
        .limit(1)
        .with_for_update()
    )
    if restored is None:
        raise AdminError(
            409,
            "no_previous_production",
            f"{current.name} has no previous production to return to.",
        )
    before = {"production": current.name, "restores": _checkpoint_state(restored)}
    now = datetime.now(UTC)
    current.status = CheckpointStatus.rolled_back
    current.retired_at = now
    session.flush()
    restored.status = CheckpointStatus.production
    restored.promoted_at = now
    restored.retired_at = None
    stopped = _stop_experiments_with(session, [current.id], now)
    session.flush()
    return audit(
        session,
        actor,
        "checkpoint.rollback",
        f"checkpoint:{current.name}",
        before,
        {
            "production": restored.name,
            "rolled_back": current.name,
            "stopped_experiments": stopped,
            "reason": reason,
        },
    )


def rollback_canary(
    session: Session, name: str, actor: Actor, reason: str | None = None
) -> AuditEntry:
    """A canary (or candidate) becomes `rolled_back`; experiments that serve it stop."""
    lock_routing(session)
    checkpoint = checkpoint_named(session, name, lock=True)
    if checkpoint.status not in (CheckpointStatus.canary, CheckpointStatus.candidate):
        raise AdminError(
            409,
            "not_a_canary",
            f"{name} is {checkpoint.status.value}; only a canary or candidate can be rolled "
            "back this way.",
        )
    before = {"checkpoint": _checkpoint_state(checkpoint)}
    now = datetime.now(UTC)
    checkpoint.status = CheckpointStatus.rolled_back
    checkpoint.retired_at = now
    stopped = _stop_experiments_with(session, [checkpoint.id], now)
    session.flush()
    return audit(
        session,
        actor,
        "checkpoint.rollback",
        f"checkpoint:{name}",
        before,
        {
            "checkpoint": _checkpoint_state(checkpoint),
            "stopped_experiments": stopped,
            "reason": reason,
        },
    )


def _stop_experiments_with(session: Session, checkpoint_ids: list[int], now: datetime) -> list[int]:
    """Stop every draft or running experiment with an arm on these checkpoints."""
    experiments = session.scalars(
        select(Experiment)
        .where(
            Experiment.status.in_(OPEN_EXPERIMENTS),
            Experiment.id.in_(
                select(Arm.experiment_id).where(Arm.checkpoint_id.in_(checkpoint_ids))
            ),
        )
        .with_for_update()
    ).all()
    for experiment in experiments:
        experiment.status = ExperimentStatus.stopped
        experiment.stopped_at = now
    return sorted(experiment.id for experiment in experiments)


# -- API keys ------------------------------------------------------------------------------


def _key_state(row: ApiKey) -> dict[str, Any]:
    return {
        "id": str(row.id),
        "name": row.name,
        "role": row.role.value,
        "key_prefix": row.key_prefix,
        "privacy_mode": row.privacy_mode,
        "rate_limit_per_minute": row.rate_limit_per_minute,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
        "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None,
    }


async def issue_api_key(
    session: AsyncSession, spec: ApiKeyCreate, actor: Actor
) -> tuple[ApiKey, str]:
    """A new key and its secret (shown once; only the hash is stored)."""
    row, secret = await create_api_key(
        session,
        name=spec.name,
        role=spec.role,
        privacy_mode=spec.privacy_mode,
        rate_limit_per_minute=spec.rate_limit_per_minute,
        expires_at=spec.expires_at,
        created_by=actor.name,
    )
    await session.refresh(row)
    audit(session, actor, "api_key.create", f"api_key:{row.id}", None, _key_state(row))
    await session.flush()
    return row, secret


async def revoke_api_key(session: AsyncSession, key_id: uuid.UUID, actor: Actor) -> AuditEntry:
    """Revoke a key; gateways stop accepting it within their authentication cache's TTL."""
    row = await session.get(ApiKey, key_id, with_for_update=True)
    if row is None:
        raise AdminError(404, "api_key_not_found", f"API key {key_id} does not exist.")
    if row.revoked_at is not None:
        raise AdminError(409, "api_key_revoked", f"API key {key_id} is already revoked.")
    before = _key_state(row)
    row.revoked_at = datetime.now(UTC)
    entry = audit(session, actor, "api_key.revoke", f"api_key:{row.id}", before, _key_state(row))
    await session.flush()
    return entry


async def list_api_keys(session: AsyncSession, include_revoked: bool) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at.desc())
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return list((await session.scalars(query)).all())


# -- training ------------------------------------------------------------------------------


def flag(session: Session, name: str) -> bool:
    return bool(session.scalar(select(ControlFlag.value).where(ControlFlag.name == name)))


def _set_flag(session: Session, name: str, value: bool, actor: Actor) -> None:
    now = func.now()
    session.execute(
        insert(ControlFlag)
        .values(name=name, value=value, updated_by=actor.name, updated_at=now)
        .on_conflict_do_update(
            index_elements=[ControlFlag.name],
            set_={"value": value, "updated_by": actor.name, "updated_at": now},
        )
    )


def set_training_paused(
    session: Session, paused: bool, actor: Actor, reason: str | None = None
) -> AuditEntry:
    """Pause or resume the trainer's cycles (a cycle already running finishes)."""
    before = flag(session, TRAINING_PAUSED)
    _set_flag(session, TRAINING_PAUSED, paused, actor)
    return audit(
        session,
        actor,
        "training.pause" if paused else "training.resume",
        f"flag:{TRAINING_PAUSED}",
        {"paused": before},
        {"paused": paused, "reason": reason},
    )


def request_training_cycle(session: Session, actor: Actor) -> AuditEntry:
    """Ask the trainer to run a cycle now rather than at its next interval."""
    if flag(session, TRAINING_PAUSED):
        raise AdminError(409, "training_paused", "Training is paused; resume it first.")
    before = flag(session, CYCLE_REQUESTED)
    _set_flag(session, CYCLE_REQUESTED, True, actor)
    return audit(
        session,
        actor,
        "training.cycle",
        f"flag:{CYCLE_REQUESTED}",
        {"requested": before},
        {"requested": True},
    )


def audit_entries(
    session: Session, target: str | None, action: str | None, limit: int
) -> list[AuditEntry]:
    query = select(AuditEntry).order_by(AuditEntry.id.desc()).limit(limit)
    if target is not None:
        query = query.where(AuditEntry.target == target)
    if action is not None:
        query = query.where(AuditEntry.action == action)
    return list(session.scalars(query))
