"""`rtrl trainer`: a cycle every interval, one at a time, pausable by ops."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import Engine

from app.config import Settings
from app.db import session_scope
from app.heartbeat import Heartbeat
from app.registry.audit import Actor
from app.registry.flags import CYCLE_REQUESTED, TRAINING_PAUSED, flag, set_flag
from app.registry.routing import notify_routing_changed_sync
from trainer.config import TrainConfig
from trainer.cycle import run_cycle
from trainer.evaluate import HeldOut
from trainer.lock import CycleBusy

log = logging.getLogger("rtrl.trainer")
TRAINER_ACTOR = Actor("trainer")


def run_scheduler(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    held_out: HeldOut,
    stop: threading.Event,
    poll_seconds: float = 5.0,
) -> None:
    """Run a cycle every `settings.train_interval` (or when ops request one) until `stop`."""
    interval = settings.train_interval.total_seconds()
    next_cycle = time.monotonic() + interval
    paused_logged = False
    heartbeat = Heartbeat(settings.heartbeat_file)
    heartbeat.beat()

    def progress(line: str) -> None:
        heartbeat.beat()  # a cycle reports progress per phase and per epoch: it is alive
        log.info(line)

    log.info("trainer scheduler: a cycle every %s", settings.train_interval)
    while not stop.wait(timeout=min(poll_seconds, max(0.0, next_cycle - time.monotonic()))):
        heartbeat.beat()
        with session_scope(engine) as session:
            paused = flag(session, TRAINING_PAUSED)
            requested = flag(session, CYCLE_REQUESTED)
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
                set_flag(session, CYCLE_REQUESTED, False, TRAINER_ACTOR)
        try:
            result = run_cycle(
                settings,
                config,
                engine=engine,
                held_out=held_out,
                progress=progress,
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
