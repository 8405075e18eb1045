"""Checkpoints: lineage, promotion and rollback.

Each change runs in the caller's transaction under the routing lock (so two changes to
routing never interleave), refuses invalid transitions with a `RegistryError`, and writes an
audit entry (who, what, before, after) beside the change. The caller commits, then tells
every gateway to reload its routing table.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import literal, select
from sqlalchemy.orm import Session

from app.models import (
    Alert,
    Arm,
    AuditEntry,
    Checkpoint,
    CheckpointStatus,
    Experiment,
    ExperimentStatus,
    TrainingRun,
)
from app.registry.audit import Actor, RegistryError, audit
from app.registry.routing import lock_routing

OPEN_EXPERIMENTS = (ExperimentStatus.draft, ExperimentStatus.running)


def checkpoint_named(session: Session, name: str, *, lock: bool = False) -> Checkpoint:
    query = select(Checkpoint).where(Checkpoint.name == name)
    checkpoint = session.scalar(query.with_for_update() if lock else query)
    if checkpoint is None:
        raise RegistryError(404, "checkpoint_not_found", f"Checkpoint {name!r} does not exist.")
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


def _checkpoint_state(checkpoint: Checkpoint | None) -> dict[str, Any] | None:
    if checkpoint is None:
        return None
    return {"name": checkpoint.name, "status": checkpoint.status.value}


def _production(session: Session) -> Checkpoint | None:
    return session.scalar(
        select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production).with_for_update()
    )


def promote(
    session: Session,
    name: str,
    actor: Actor,
    reason: str | None = None,
    *,
    override_alerts: bool = False,
) -> AuditEntry:
    """Make a candidate or canary the production checkpoint; the previous one is retired.

    The previous production stays `retired` (not `rolled_back`), so a rollback can return
    to it. Running experiments that involve either checkpoint are stopped: their control
    no longer is production. A checkpoint the reward-hacking monitors raised alerts on is
    refused unless `override_alerts`: a reward can be gamed while the A/B metrics it
    drives still look like a win.
    """
    lock_routing(session)
    checkpoint = checkpoint_named(session, name, lock=True)
    alerts = session.scalars(select(Alert).where(Alert.checkpoint == name).order_by(Alert.id)).all()
    if alerts and not override_alerts:
        found = "; ".join(
            f"{alert.metric} {alert.canary_value:.3g} vs {alert.control_checkpoint}"
            f" {alert.control_value:.3g}"
            for alert in alerts
        )
        raise RegistryError(
            409,
            "monitor_alerts",
            f"{name} has reward-hacking monitor alerts ({found}); it is not promoted. Fix the "
            "reward and train again, or pass override_alerts with a reason.",
        )
    if checkpoint.status == CheckpointStatus.production:
        raise RegistryError(409, "already_production", f"{name} is already production.")
    if checkpoint.status not in (CheckpointStatus.candidate, CheckpointStatus.canary):
        raise RegistryError(
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
            **({"overridden_alerts": [alert.id for alert in alerts]} if alerts else {}),
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
    raise RegistryError(
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
        raise RegistryError(409, "no_production", "No checkpoint is production.")
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
        raise RegistryError(
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
        raise RegistryError(
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
