"""Experiment lifecycle used by ops and by the trainer's canary rollout.

Ops' changes (create, start, ramp, stop) and the trainer's canaries run in the caller's
transaction under the routing lock, refuse invalid transitions with an `RegistryError`, and
write their audit entries.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload

from app.models import (
    LIVE_STATUSES,
    Arm,
    AuditEntry,
    Checkpoint,
    CheckpointStatus,
    Experiment,
    ExperimentStatus,
)
from app.registry.audit import Actor, RegistryError, audit
from app.registry.buckets import ArmWeight, check_layout, check_ramp
from app.registry.checkpoints import OPEN_EXPERIMENTS, checkpoint_names
from app.registry.routing import lock_routing
from app.registry.schemas import ExperimentCreate

ROUTE = "chat"
FULL_BPS = 10_000


def running_experiment(session: Session, route: str = ROUTE) -> Experiment | None:
    return session.scalar(
        select(Experiment).where(
            Experiment.route == route, Experiment.status == ExperimentStatus.running
        )
    )


def start_canary(
    session: Session,
    *,
    control: Checkpoint,
    treatment: Checkpoint,
    treatment_bps: int,
    created_by: str,
    actor: Actor | None = None,
    route: str = ROUTE,
) -> Experiment:
    """Start control vs treatment at a canary share, superseding the route's running
    experiment; audited as `actor` (by default, the creator)."""
    if not 0 < treatment_bps < FULL_BPS:
        raise ValueError(f"treatment share must be between 1 and 9999 bps, got {treatment_bps}")
    actor = actor or Actor(created_by)
    lock_routing(session)
    previous = running_experiment(session, route)
    if previous is not None:
        supersede(session, previous, treatment, actor)
    now = datetime.now(UTC)
    experiment = Experiment(
        name=f"{treatment.name}-vs-{control.name}-{now:%Y%m%d%H%M%S}",
        route=route,
        salt=secrets.token_hex(8),
        status=ExperimentStatus.running,
        created_by=created_by,
        started_at=now,
        arms=[
            Arm(
                name="control",
                checkpoint_id=control.id,
                weight_bps=FULL_BPS - treatment_bps,
                is_control=True,
            ),
            Arm(name="treatment", checkpoint_id=treatment.id, weight_bps=treatment_bps),
        ],
    )
    session.add(experiment)
    if treatment.status == CheckpointStatus.candidate:
        treatment.status = CheckpointStatus.canary
    session.flush()
    names = {control.id: control.name, treatment.id: treatment.name}
    audit(
        session,
        actor,
        "experiment.start",
        f"experiment:{experiment.id}",
        None,
        experiment_state(experiment, names),
    )
    return experiment


def supersede(session: Session, experiment: Experiment, newer: Checkpoint, actor: Actor) -> None:
    """Stop a running experiment for `newer`'s canary; the canaries it tried from `newer`'s
    parent are retired, superseded by it (they were not found worse, only replaced by a
    candidate trained on more evidence). Each change is audited with the reason."""
    reason = f"superseded by {newer.name}"
    stop_experiment(session, experiment.id, actor, reason)
    treatments = [arm.checkpoint_id for arm in experiment.arms if not arm.is_control]
    superseded = session.scalars(
        select(Checkpoint)
        .where(
            Checkpoint.id.in_(treatments),
            Checkpoint.id != newer.id,
            Checkpoint.status == CheckpointStatus.canary,
            Checkpoint.parent_id == newer.parent_id,
        )
        .with_for_update()
    ).all()
    now = datetime.now(UTC)
    for checkpoint in superseded:
        before = {"name": checkpoint.name, "status": checkpoint.status.value}
        checkpoint.status = CheckpointStatus.retired
        checkpoint.retired_at = now
        checkpoint.superseded_by_id = newer.id
        audit(
            session,
            actor,
            "checkpoint.retire",
            f"checkpoint:{checkpoint.name}",
            before,
            {
                "name": checkpoint.name,
                "status": checkpoint.status.value,
                "superseded_by": newer.name,
                "reason": reason,
            },
        )
    session.flush()


def experiment_by_id(session: Session, experiment_id: int, *, lock: bool = False) -> Experiment:
    query = (
        select(Experiment)
        .where(Experiment.id == experiment_id)
        .options(selectinload(Experiment.arms))
    )
    experiment = session.scalar(query.with_for_update() if lock else query)
    if experiment is None:
        raise RegistryError(
            404, "experiment_not_found", f"Experiment {experiment_id} does not exist."
        )
    return experiment


def list_experiments(session: Session, status: ExperimentStatus | None) -> list[Experiment]:
    query = select(Experiment).options(selectinload(Experiment.arms)).order_by(Experiment.id.desc())
    if status is not None:
        query = query.where(Experiment.status == status)
    return list(session.scalars(query))


def experiments_serving(session: Session, checkpoint_id: int) -> list[Experiment]:
    """Experiments with an arm on the checkpoint, newest first."""
    return list(
        session.scalars(
            select(Experiment)
            .where(
                Experiment.id.in_(
                    select(Arm.experiment_id).where(Arm.checkpoint_id == checkpoint_id)
                )
            )
            .options(selectinload(Experiment.arms))
            .order_by(Experiment.id.desc())
        )
    )


def experiment_state(experiment: Experiment, names: dict[int, str]) -> dict[str, Any]:
    """An experiment as the audit log records it."""
    return {
        "id": experiment.id,
        "name": experiment.name,
        "route": experiment.route,
        "status": experiment.status.value,
        "arms": [
            {
                "name": arm.name,
                "checkpoint": names.get(arm.checkpoint_id),
                "weight_bps": arm.weight_bps,
                "is_control": arm.is_control,
            }
            for arm in experiment.arms
        ],
    }


def _check_weights(weights: dict[str, int]) -> None:
    for arm, weight in weights.items():
        if not 0 <= weight <= FULL_BPS:
            raise RegistryError(
                422,
                "invalid_weight",
                f"Arm {arm!r}: weight {weight} is outside 0..{FULL_BPS} basis points.",
                param="weights",
            )
    total = sum(weights.values())
    if total != FULL_BPS:
        raise RegistryError(
            422,
            "weights_do_not_sum_to_10000",
            f"Arm weights sum to {total} basis points; they must sum to {FULL_BPS}.",
            param="weights",
        )


def _check_live(session: Session, checkpoint_ids: Iterable[int]) -> None:
    not_live = session.execute(
        select(Checkpoint.name, Checkpoint.status).where(
            Checkpoint.id.in_(list(checkpoint_ids)), Checkpoint.status.not_in(LIVE_STATUSES)
        )
    ).all()
    if not_live:
        described = ", ".join(f"{row.name} is {row.status.value}" for row in not_live)
        raise RegistryError(
            409,
            "checkpoint_not_live",
            f"An experiment can only serve live checkpoints: {described}.",
        )


def create_experiment(session: Session, spec: ExperimentCreate, actor: Actor) -> Experiment:
    """Create an experiment as a draft (or started, with `spec.start`)."""
    lock_routing(session)
    if session.scalar(select(Experiment.id).where(Experiment.name == spec.name)) is not None:
        raise RegistryError(
            409, "experiment_name_taken", f"An experiment named {spec.name!r} exists.", param="name"
        )
    names = [arm.name for arm in spec.arms]
    if len(set(names)) != len(names):
        raise RegistryError(422, "duplicate_arm", "Arm names must be unique.", param="arms")
    if sum(arm.is_control for arm in spec.arms) != 1:
        raise RegistryError(
            422, "one_control_arm", "Exactly one arm must be the control.", param="arms"
        )
    _check_weights({arm.name: arm.weight_bps for arm in spec.arms})
    check_layout([ArmWeight(arm.name, arm.weight_bps, arm.is_control) for arm in spec.arms])
    checkpoints = {
        row.name: row.id
        for row in session.execute(
            select(Checkpoint.name, Checkpoint.id).where(
                Checkpoint.name.in_([arm.checkpoint for arm in spec.arms])
            )
        )
    }
    for index, arm in enumerate(spec.arms):
        if arm.checkpoint not in checkpoints:
            raise RegistryError(
                422,
                "checkpoint_not_found",
                f"Arm {arm.name!r}: checkpoint {arm.checkpoint!r} does not exist.",
                param=f"arms.{index}.checkpoint",
            )
    _check_live(session, checkpoints.values())
    experiment = Experiment(
        name=spec.name,
        route=spec.route,
        salt=uuid.uuid4().hex[:16],
        status=ExperimentStatus.draft,
        created_by=actor.name,
        arms=[
            Arm(
                name=arm.name,
                checkpoint_id=checkpoints[arm.checkpoint],
                weight_bps=arm.weight_bps,
                is_control=arm.is_control,
            )
            for arm in spec.arms
        ],
    )
    session.add(experiment)
    session.flush()
    audit(
        session,
        actor,
        "experiment.create",
        f"experiment:{experiment.id}",
        None,
        experiment_state(experiment, checkpoint_names(session, checkpoints.values())),
    )
    if spec.start:
        start_experiment(session, experiment.id, actor)
    session.flush()
    return experiment


def start_experiment(session: Session, experiment_id: int, actor: Actor) -> AuditEntry:
    """Start a draft: its arms begin serving; candidate checkpoints become canaries."""
    lock_routing(session)
    experiment = experiment_by_id(session, experiment_id, lock=True)
    if experiment.status != ExperimentStatus.draft:
        raise RegistryError(
            409,
            "not_a_draft",
            f"Experiment {experiment_id} is {experiment.status.value}; only a draft can start.",
        )
    running = session.scalar(
        select(Experiment).where(
            Experiment.route == experiment.route, Experiment.status == ExperimentStatus.running
        )
    )
    if running is not None:
        raise RegistryError(
            409,
            "route_has_running_experiment",
            f"Experiment {running.id} ({running.name}) is already running on route "
            f"{experiment.route!r}; stop it first.",
        )
    checkpoint_ids = [arm.checkpoint_id for arm in experiment.arms]
    _check_live(session, checkpoint_ids)
    names = checkpoint_names(session, checkpoint_ids)
    before = experiment_state(experiment, names)
    experiment.status = ExperimentStatus.running
    experiment.started_at = datetime.now(UTC)
    treatment_ids = [arm.checkpoint_id for arm in experiment.arms if not arm.is_control]
    for checkpoint in session.scalars(
        select(Checkpoint).where(
            Checkpoint.id.in_(treatment_ids), Checkpoint.status == CheckpointStatus.candidate
        )
    ):
        checkpoint.status = CheckpointStatus.canary
    session.flush()
    return audit(
        session,
        actor,
        "experiment.start",
        f"experiment:{experiment_id}",
        before,
        experiment_state(experiment, names),
    )


def ramp_experiment(
    session: Session, experiment_id: int, weights: dict[str, int], actor: Actor
) -> AuditEntry:
    """Change the arms' weights; every arm is named and the weights sum to 10000."""
    lock_routing(session)
    experiment = experiment_by_id(session, experiment_id, lock=True)
    if experiment.status not in OPEN_EXPERIMENTS:
        raise RegistryError(
            409, "experiment_stopped", f"Experiment {experiment_id} is stopped; it cannot ramp."
        )
    arms = {arm.name: arm for arm in experiment.arms}
    unknown, missing = weights.keys() - arms.keys(), arms.keys() - weights.keys()
    if unknown or missing:
        raise RegistryError(
            422,
            "arms_mismatch",
            f"Weights must name exactly the arms {sorted(arms)}; "
            f"unknown: {sorted(unknown)}, missing: {sorted(missing)}.",
            param="weights",
        )
    _check_weights(weights)
    ramped = [ArmWeight(name, weights[name], arm.is_control) for name, arm in arms.items()]
    check_layout(ramped)
    if experiment.status == ExperimentStatus.running:
        check_ramp({name: arm.weight_bps for name, arm in arms.items()}, ramped)
    names = checkpoint_names(session, [arm.checkpoint_id for arm in experiment.arms])
    before = experiment_state(experiment, names)
    for name, weight in weights.items():
        arms[name].weight_bps = weight
    session.flush()
    return audit(
        session,
        actor,
        "experiment.ramp",
        f"experiment:{experiment_id}",
        before,
        experiment_state(experiment, names),
    )


def stop_experiment(
    session: Session, experiment_id: int, actor: Actor, reason: str | None = None
) -> AuditEntry:
    """Stop a draft or running experiment: everyone is served production again."""
    lock_routing(session)
    experiment = experiment_by_id(session, experiment_id, lock=True)
    if experiment.status == ExperimentStatus.stopped:
        raise RegistryError(
            409, "experiment_stopped", f"Experiment {experiment_id} is already stopped."
        )
    names = checkpoint_names(session, [arm.checkpoint_id for arm in experiment.arms])
    before = experiment_state(experiment, names)
    experiment.status = ExperimentStatus.stopped
    experiment.stopped_at = datetime.now(UTC)
    session.flush()
    after = experiment_state(experiment, names) | {"reason": reason}
    return audit(session, actor, "experiment.stop", f"experiment:{experiment_id}", before, after)
