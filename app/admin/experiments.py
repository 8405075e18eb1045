"""Experiment lifecycle used by ops and by the trainer's canary rollout."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Arm, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus

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
    route: str = ROUTE,
) -> Experiment:
    """Stop the route's running experiment and start control vs treatment at a canary share."""
    if not 0 < treatment_bps < FULL_BPS:
        raise ValueError(f"treatment share must be between 1 and 9999 bps, got {treatment_bps}")
    now = datetime.now(UTC)
    previous = running_experiment(session, route)
    if previous is not None:
        previous.status = ExperimentStatus.stopped
        previous.stopped_at = now
        session.flush()  # the partial unique index allows one running experiment per route
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
    return experiment
