"""The training cadence in Postgres, so any number of trainers run one cycle per interval.

A route's row holds when its next scheduled cycle is due. A trainer takes a cycle under the
trainer lock, in one transaction: an ops request first (one extra cycle, the due time
unchanged), else the scheduled cycle once due, whose due time it advances past now. A trainer
that comes after finds the new due time and sleeps until then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import func, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.models import CycleTrigger, TrainingSchedule
from app.registry.audit import Actor
from app.registry.experiments import ROUTE
from app.registry.flags import CYCLE_REQUESTED, TRAINING_PAUSED, flag, take_flag


@dataclass(frozen=True)
class Claim:
    """What a trainer may run now, and when the next scheduled cycle is due."""

    trigger: CycleTrigger | None
    """Why a cycle runs now; None when none may."""
    due_at: datetime
    now: datetime
    """The database's clock, the one every trainer shares."""
    paused: bool = False

    @property
    def wait(self) -> timedelta:
        """How long until the next scheduled cycle is due."""
        return max(self.due_at - self.now, timedelta(0))


def next_cycle_at(session: Session, route: str = ROUTE) -> datetime | None:
    """When the route's next scheduled cycle is due; None before a trainer has started."""
    return session.scalar(select(TrainingSchedule.due_at).where(TrainingSchedule.route == route))


def claim_cycle(session: Session, interval: timedelta, actor: Actor, route: str = ROUTE) -> Claim:
    """Take the pending request or the due scheduled cycle, if training is not paused.

    The schedule's row stays locked until the caller commits, so of the trainers that claim
    at once exactly one takes a cycle; the first claim ever schedules a cycle one interval on.
    """
    now: datetime = session.execute(select(func.now())).scalar_one()
    session.execute(
        insert(TrainingSchedule)
        .values(route=route, due_at=now + interval)
        .on_conflict_do_nothing(index_elements=[TrainingSchedule.route])
    )
    schedule = session.scalars(
        select(TrainingSchedule).where(TrainingSchedule.route == route).with_for_update()
    ).one()
    if schedule.due_at > now + interval:
        schedule.due_at = now + interval  # a shortened interval need not wait out the old one
    if flag(session, TRAINING_PAUSED):
        return Claim(None, schedule.due_at, now, paused=True)
    if take_flag(session, CYCLE_REQUESTED, actor):
        return Claim(CycleTrigger.request, schedule.due_at, now)
    if schedule.due_at > now:
        return Claim(None, schedule.due_at, now)
    schedule.due_at = following_due(schedule.due_at, now, interval)
    return Claim(CycleTrigger.schedule, schedule.due_at, now)


def following_due(due_at: datetime, now: datetime, interval: timedelta) -> datetime:
    """The first due time after `now` on the schedule's grid: intervals that passed while no
    trainer ran come to one cycle."""
    missed = (now - due_at) // interval
    return due_at + (missed + 1) * interval
