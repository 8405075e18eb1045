"""`rtrl trainer`: a cycle every interval, one at a time, pausable by ops."""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Engine, select
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.config import Settings
from app.db import session_scope
from app.gateway.assignment import notify_routing_changed_sync
from app.models import ControlFlag
from trainer.config import TrainConfig
from trainer.cycle import run_cycle
from trainer.lock import CycleBusy

log = logging.getLogger("rtrl.trainer")

TRAINING_PAUSED = "training_paused"
CYCLE_REQUESTED = "training_cycle_requested"


def set_flag(session: Session, name: str, value: Any, *, by: str) -> None:
    """Upsert a control flag."""
    session.execute(
        insert(ControlFlag)
        .values(name=name, value=value, updated_by=by, updated_at=datetime.now(UTC))
        .on_conflict_do_update(
            index_elements=[ControlFlag.name],
            set_={"value": value, "updated_by": by, "updated_at": datetime.now(UTC)},
        )
    )


def flag(session: Session, name: str, default: Any = None) -> Any:
    value = session.scalar(select(ControlFlag.value).where(ControlFlag.name == name))
    return default if value is None else value


def run_scheduler(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    stop: threading.Event,
    poll_seconds: float = 5.0,
) -> None:
    """Run a cycle every `settings.train_interval` (or when ops request one) until `stop`."""
    interval = settings.train_interval.total_seconds()
    next_cycle = time.monotonic() + interval
    paused_logged = False
    log.info("trainer scheduler: a cycle every %s", settings.train_interval)
    while not stop.wait(timeout=min(poll_seconds, max(0.0, next_cycle - time.monotonic()))):
        with session_scope(engine) as session:
            paused = bool(flag(session, TRAINING_PAUSED, False))
            requested = bool(flag(session, CYCLE_REQUESTED, False))
        if paused:
            if not paused_logged:
                log.info("training is paused; waiting")
            paused_logged = True
            continue
        paused_logged = False
        if not requested and time.monotonic() < next_cycle:
            continue
        if requested:
            with session_scope(engine) as session:
                set_flag(session, CYCLE_REQUESTED, False, by="trainer")
        try:
            result = run_cycle(
                settings,
                config,
                engine=engine,
                on_published=lambda: notify_routing_changed_sync(settings.redis_url),
            )
            log.info(
                "cycle finished: run %s %s %s", result.run_id, result.status, result.reason or ""
            )
        except CycleBusy:
            log.info("another trainer is running a cycle; skipping this one")
        except Exception:
            log.exception("training cycle failed; the next one starts clean")
        next_cycle = time.monotonic() + interval
