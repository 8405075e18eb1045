"""Control flags in Postgres: ops pause, resume or request training cycles; trainers read them."""

from __future__ import annotations

from sqlalchemy import Boolean, cast, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.models import AuditEntry, ControlFlag
from app.registry.audit import Actor, RegistryError, audit

TRAINING_PAUSED = "training_paused"
CYCLE_REQUESTED = "training_cycle_requested"


def flag(session: Session, name: str) -> bool:
    """A flag's value; an unset flag is off."""
    return bool(session.scalar(select(ControlFlag.value).where(ControlFlag.name == name)))


def set_flag(session: Session, name: str, value: bool, actor: Actor) -> None:
    """Upsert a flag, recording who set it."""
    now = func.now()
    session.execute(
        insert(ControlFlag)
        .values(name=name, value=value, updated_by=actor.name, updated_at=now)
        .on_conflict_do_update(
            index_elements=[ControlFlag.name],
            set_={"value": value, "updated_by": actor.name, "updated_at": now},
        )
    )


def take_flag(session: Session, name: str, actor: Actor) -> bool:
    """Turn a flag off if it is on; true for the one caller, of any number, that turned it off."""
    taken = session.scalar(
        update(ControlFlag)
        .where(ControlFlag.name == name, cast(ControlFlag.value, Boolean).is_(True))
        .values(value=False, updated_by=actor.name, updated_at=func.now())
        .returning(ControlFlag.name)
    )
    return taken is not None


def set_training_paused(
    session: Session, paused: bool, actor: Actor, reason: str | None = None
) -> AuditEntry:
    """Pause or resume the trainer's cycles (a cycle already running finishes)."""
    before = flag(session, TRAINING_PAUSED)
    set_flag(session, TRAINING_PAUSED, paused, actor)
    return audit(
        session,
        actor,
        "training.pause" if paused else "training.resume",
        f"flag:{TRAINING_PAUSED}",
        {"paused": before},
        {"paused": paused, "reason": reason},
    )


def request_training_cycle(session: Session, actor: Actor) -> AuditEntry:
    """Ask for one extra cycle now; one trainer takes it. Requests made before a trainer takes
    one come to that one cycle."""
    if flag(session, TRAINING_PAUSED):
        raise RegistryError(409, "training_paused", "Training is paused; resume it first.")
    before = flag(session, CYCLE_REQUESTED)
    set_flag(session, CYCLE_REQUESTED, True, actor)
    return audit(
        session,
        actor,
        "training.cycle",
        f"flag:{CYCLE_REQUESTED}",
        {"requested": before},
        {"requested": True},
    )
