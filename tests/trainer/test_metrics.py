"""The trainer's metrics: each run that ends is counted by outcome, and the time of the latest
failure survives a restart, so the alert on it does too."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, delete

from app.db import session_scope
from app.models import TrainingRun, TrainingRunStatus
from trainer.cycle import finish_run
from trainer.metrics import LAST_FINISHED, load_last_finished


@pytest.fixture
def runs(engine: Engine) -> Iterator[list[int]]:
    """Ids of the runs a test adds, deleted after it: other tests read the run history."""
    added: list[int] = []
    yield added
    with session_scope(engine) as session:
        session.execute(delete(TrainingRun).where(TrainingRun.id.in_(added)))


def new_run(engine: Engine, runs: list[int], **fields: Any) -> int:
    with session_scope(engine) as session:
        run = TrainingRun(**({"status": TrainingRunStatus.running, "config": {}} | fields))
        session.add(run)
        session.flush()
        runs.append(run.id)
        return run.id


def last_finished(status: str) -> float | None:
    return REGISTRY.get_sample_value(
        "rtrl_training_run_last_finished_timestamp_seconds", {"status": status}
    )


def test_a_refused_run_is_counted_and_timed(engine: Engine, runs: list[int]) -> None:
    refused = REGISTRY.get_sample_value("rtrl_training_runs_total", {"status": "refused"})
    before = datetime.now(UTC).timestamp()

    finish_run(engine, new_run(engine, runs), TrainingRunStatus.refused, reason="drift")

    counted = REGISTRY.get_sample_value("rtrl_training_runs_total", {"status": "refused"})
    assert counted == (refused or 0) + 1
    assert before <= (last_finished("refused") or 0) <= datetime.now(UTC).timestamp()


def test_a_restarted_trainer_reads_the_latest_failure_back_from_postgres(
    engine: Engine, runs: list[int]
) -> None:
    # Later than any other run in this database, as the latest failure is after a crash.
    failed_at = datetime.now(UTC) + timedelta(days=1)
    new_run(engine, runs, status=TrainingRunStatus.failed, finished_at=failed_at)
    LAST_FINISHED.clear()  # as in a fresh process

    load_last_finished(engine)

    assert last_finished("failed") == pytest.approx(failed_at.timestamp())
