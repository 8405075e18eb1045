"""The training cadence: one cycle per interval however many trainers run, as real processes
over the session's Postgres, and the due-time logic they share."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from itertools import pairwise
from pathlib import Path

import pytest
from sqlalchemy import Engine, delete, select, update

from app.config import Settings
from app.db import session_scope
from app.models import (
    Checkpoint,
    ControlFlag,
    CycleTrigger,
    TrainingRun,
    TrainingRunStatus,
    TrainingSchedule,
)
from app.processes import free_port
from app.registry.audit import Actor
from app.registry.flags import TRAINING_PAUSED, request_training_cycle, set_flag
from app.registry.schedule import claim_cycle
from rtrl.embedded.stack import EmbeddedStack
from sandbox.task_family import task_family_held_out
from tests.trainer.conftest import (
    StartTrainers,
    first_due,
    runs,
    sleep_until,
    store_samples,
    trainer_settings,
)
from trainer.config import TrainConfig
from trainer.cycle import run_cycle, skip_reason
from trainer.data import OnPolicyBatch, TrainingSample

OPS = Actor("ops")
TRAINER = Actor("trainer")
MINUTE = timedelta(minutes=1)


@pytest.fixture
def schedule(engine: Engine) -> Engine:
    """No schedule yet, no request, training not paused."""
    with session_scope(engine) as session:
        session.execute(delete(TrainingSchedule))
        session.execute(delete(ControlFlag))
    return engine


def claim(engine: Engine, interval: timedelta = MINUTE) -> tuple[CycleTrigger | None, datetime]:
    with session_scope(engine) as session:
        taken = claim_cycle(session, interval, TRAINER)
    return taken.trigger, taken.due_at


def set_due(engine: Engine, due_at: datetime) -> None:
    with session_scope(engine) as session:
        session.execute(update(TrainingSchedule).values(due_at=due_at))


# -- the due-time logic, against Postgres --------------------------------------------------


def test_the_first_claim_schedules_a_cycle_one_interval_on(schedule: Engine) -> None:
    before = datetime.now(UTC)
    trigger, due = claim(schedule)
    assert trigger is None
    assert before + MINUTE - timedelta(seconds=5) < due < datetime.now(UTC) + MINUTE
    assert claim(schedule) == (None, due)


def test_a_due_cycle_is_taken_once_and_the_next_stays_on_the_grid(schedule: Engine) -> None:
    claim(schedule)
    missed = datetime.now(UTC) - 2.5 * MINUTE  # three due times passed while no trainer ran
    set_due(schedule, missed)

    trigger, due = claim(schedule)

    assert trigger == CycleTrigger.schedule
    assert due == missed + 3 * MINUTE
    assert claim(schedule) == (None, due)


def test_of_trainers_claiming_at_once_exactly_one_takes_the_due_cycle(schedule: Engine) -> None:
    claim(schedule)
    set_due(schedule, datetime.now(UTC) - timedelta(seconds=1))
    start = threading.Barrier(6)
    taken: list[CycleTrigger | None] = []

    def trainer() -> None:
        start.wait()
        taken.append(claim(schedule)[0])

    threads = [threading.Thread(target=trainer) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert len(taken) == 6 and taken.count(CycleTrigger.schedule) == 1


def test_a_request_is_one_extra_cycle_that_leaves_the_schedule_alone(schedule: Engine) -> None:
    _, due = claim(schedule)
    with session_scope(schedule) as session:
        request_training_cycle(session, OPS)
        request_training_cycle(session, OPS)  # before a trainer takes it: still one cycle

    assert claim(schedule) == (CycleTrigger.request, due)
    assert claim(schedule) == (None, due)


def test_paused_training_takes_neither_requests_nor_due_cycles(schedule: Engine) -> None:
    claim(schedule)
    with session_scope(schedule) as session:
        request_training_cycle(session, OPS)
        set_flag(session, TRAINING_PAUSED, True, OPS)
    set_due(schedule, datetime.now(UTC) - timedelta(seconds=1))

    assert claim(schedule)[0] is None

    with session_scope(schedule) as session:
        set_flag(session, TRAINING_PAUSED, False, OPS)
    assert claim(schedule)[0] == CycleTrigger.request
    assert claim(schedule)[0] == CycleTrigger.schedule
    assert claim(schedule)[0] is None


def test_a_shorter_interval_takes_effect_at_once(schedule: Engine) -> None:
    claim(schedule, interval=timedelta(hours=5))
    _, due = claim(schedule, interval=MINUTE)
    assert due < datetime.now(UTC) + MINUTE


# -- the skip rule ------------------------------------------------------------------------


def add_run(engine: Engine, status: TrainingRunStatus, window_end: datetime) -> int:
    with session_scope(engine) as session:
        base = session.scalars(select(Checkpoint).where(Checkpoint.name == "base")).one()
        run = TrainingRun(
            status=status,
            config={},
            base_checkpoint_id=base.id,
            sample_count=64,
            window_start=window_end - timedelta(hours=1),
            window_end=window_end,
        )
        session.add(run)
        session.flush()
        return run.id


def test_a_cycle_without_new_evidence_since_the_last_run_from_production_skips(
    clean_registry: Engine, tiny_model_dir: Path, tmp_path: Path
) -> None:
    served = datetime.now(UTC)
    store_samples(clean_registry, 70, served_at=served)
    trained = add_run(clean_registry, TrainingRunStatus.published, window_end=served)
    add_run(clean_registry, TrainingRunStatus.failed, window_end=served - MINUTE)  # used nothing
    config = TrainConfig(min_samples=64, min_new_samples=16, prediction_percent=0)
    settings = Settings(
        data_dir=tmp_path, vllm_urls=["http://127.0.0.1:9"], base_model=tiny_model_dir
    )

    result = run_cycle(
        settings,
        config,
        engine=clean_registry,
        held_out=task_family_held_out(config),
        trigger=CycleTrigger.schedule,
    )

    assert result.status == TrainingRunStatus.skipped and result.checkpoint is None
    assert result.reason is not None
    assert result.reason.startswith("no new on-policy evidence: 0 finalized samples of base")
    assert f"run {trained}" in result.reason and "fewer than 16" in result.reason
    with session_scope(clean_registry) as session:
        run = session.get_one(TrainingRun, result.run_id)
        assert (run.trigger, run.sample_count) == (CycleTrigger.schedule, 70)


def test_enough_samples_served_after_the_last_window_are_new_evidence() -> None:
    end = datetime.now(UTC)
    previous = TrainingRun(id=7, window_end=end)

    def batch(old: int, new: int) -> OnPolicyBatch:
        samples = [
            TrainingSample(i, [1], [2], [-1.0], 1.0, end + timedelta(seconds=1 if i < new else -1))
            for i in range(old + new)
        ]
        return OnPolicyBatch("base", samples, end - MINUTE, end)

    config = TrainConfig(min_samples=64, min_new_samples=16)
    assert skip_reason(batch(old=60, new=16), previous, config) is None
    assert "15 finalized samples" in str(skip_reason(batch(old=60, new=15), previous, config))
    assert skip_reason(batch(old=70, new=0), None, config) is None  # no run trained from it yet
    assert "fewer than 64" in str(skip_reason(batch(old=40, new=16), previous, config))


# -- trainers as processes -----------------------------------------------------------------


@pytest.mark.scenario
@pytest.mark.slow
def test_three_trainers_run_one_cycle_per_interval_and_one_per_request(
    registry: Engine,
    stack: EmbeddedStack,
    tiny_model_dir: Path,
    tmp_path: Path,
    start_trainers: StartTrainers,
) -> None:
    interval = timedelta(seconds=15)
    nobody = f"http://127.0.0.1:{free_port()}"  # these cycles skip before they need a replica
    settings = trainer_settings(stack, tiny_model_dir, tmp_path, nobody, interval)
    trainers = start_trainers(3, settings)
    due = first_due(registry, trainers)
    traffic_stops = threading.Event()

    def traffic() -> None:  # a sample every 2 s: each cycle sees a window of its own
        while not traffic_stops.wait(2.0):
            store_samples(registry, 1)

    feeder = threading.Thread(target=traffic, daemon=True)
    feeder.start()
    try:
        sleep_until(due + interval + timedelta(seconds=3))
        with session_scope(registry) as session:
            request_training_cycle(session, OPS)
        sleep_until(due + 3 * interval + timedelta(seconds=3))
    finally:
        traffic_stops.set()
        feeder.join()

    found = runs(registry)
    scheduled = [run.started_at for run in found if run.trigger == CycleTrigger.schedule]
    requested = [run for run in found if run.trigger == CycleTrigger.request]
    for run in found:
        print(f"run {run.id}: {run.trigger} at {run.started_at:%H:%M:%S} by {run.trainer}")
    assert abs(len(scheduled) - 4) <= 1, found  # due at +0, +1, +2 and +3 intervals
    assert all(later - earlier > interval / 2 for earlier, later in pairwise(scheduled))
    assert len(requested) == 1
    windows = [(r.base_checkpoint_id, r.window_start, r.window_end) for r in found]
    assert len(set(windows)) == len(windows)
    assert {run.status for run in found} == {TrainingRunStatus.skipped}
    assert all("fewer than 64" in (run.reason or "") for run in found)
