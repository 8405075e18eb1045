"""`rtrl trainer`: one cycle per interval whatever the number of trainers, pausable by ops.

The schedule lives in Postgres (`app.registry.schedule`): a trainer claims a cycle and runs
it under the trainer lock, so a trainer that wakes after another ran the cycle finds the due
time advanced and sleeps until then. Under `torchrun` rank 0 keeps the schedule and tells the
other ranks at every poll whether to wait, train with it, or stop.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Engine

from app.config import Settings
from app.db import session_scope
from app.heartbeat import Heartbeat
from app.registry.routing import notify_routing_changed_sync
from app.registry.schedule import claim_cycle
from trainer.config import TrainConfig
from trainer.cycle import TRAINER_ACTOR, CycleContext, follow_cycle, run_locked_cycle
from trainer.distributed import SINGLE, World, share
from trainer.evaluate import HeldOut
from trainer.lock import CycleBusy, trainer_lock

log = logging.getLogger("rtrl.trainer")


def run_scheduler(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    held_out: HeldOut,
    stop: threading.Event,
    poll_seconds: float = 5.0,
    world: World = SINGLE,
) -> None:
    """Take and run the cycles that are due (or that ops request) until `stop`."""
    if not world.is_main:
        follow_scheduler(settings, config, world)
        return
    lead_scheduler(settings, config, engine, held_out, stop, poll_seconds, world)
    share("stop", world)  # (after an error the other ranks are stopped by torchrun instead)


def follow_scheduler(settings: Settings, config: TrainConfig, world: World) -> None:
    """A rank other than 0: train in each cycle rank 0 runs, until it stops."""
    while True:
        order = share("", world)
        if order == "stop":
            return
        if order == "cycle":
            follow_cycle(settings, config, world)


def lead_scheduler(
    settings: Settings,
    config: TrainConfig,
    engine: Engine,
    held_out: HeldOut,
    stop: threading.Event,
    poll_seconds: float,
    world: World,
) -> None:
    """Rank 0 (or the only process): poll the schedule, run each cycle that is due."""
    interval = settings.train_interval
    heartbeat = Heartbeat(settings.heartbeat_file)
    heartbeat.beat()

    def progress(line: str) -> None:
        heartbeat.beat()  # a cycle reports progress per phase and per epoch: it is alive
        log.info(line)

    log.info("trainer scheduler: one cycle every %s across all trainers", interval)
    wait, paused_logged = 0.0, False
    while not stop.wait(timeout=wait):
        heartbeat.beat()
        share("poll", world)
        wait = poll_seconds
        try:
            with trainer_lock(engine):
                with session_scope(engine) as session:
                    claim = claim_cycle(session, interval, TRAINER_ACTOR)
                if claim.paused and not paused_logged:
                    log.info("training is paused; waiting")
                paused_logged = claim.paused
                if claim.trigger is None:
                    # Sleep until the due time, looking for requests every poll meanwhile.
                    wait = min(poll_seconds, claim.wait.total_seconds())
                    continue
                log.info("cycle taken (%s); the next is due at %s", claim.trigger, claim.due_at)
                share("cycle", world)
                cycle = CycleContext(
                    settings,
                    config,
                    engine,
                    held_out,
                    progress=progress,
                    on_published=lambda: notify_routing_changed_sync(settings.redis_url),
                    trigger=claim.trigger,
                    world=world,
                )
                result = run_locked_cycle(cycle)
                log.info(
                    "cycle finished: run %s %s %s",
                    result.run_id,
                    result.status,
                    result.reason or "",
                )
                wait = 0.0  # another cycle may have come due, or been requested, meanwhile
        except CycleBusy:
            pass  # another trainer is claiming or running a cycle; look again after a poll
        except Exception:
            if world.distributed:
                raise  # the other ranks may be inside a collective: torchrun restarts us all
            log.exception("training cycle or schedule check failed; the next one starts clean")
