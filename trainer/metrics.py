"""Prometheus metrics of the trainer: how its training runs end, and where runs' turns could
not be merged into one sequence.

Served by rank 0 at RTRL_METRICS_PORT when it is set (`rtrl trainer`). The time of the latest
run of each outcome is read from Postgres at start-up, so an alert on a failed run survives
the restart that often follows one.
"""

from __future__ import annotations

from datetime import datetime

from prometheus_client import Counter, Gauge
from sqlalchemy import Engine, func, select

from app.db import session_scope
from app.models import TrainingRun, TrainingRunStatus

RUNS = Counter(
    "rtrl_training_runs_total", "Training runs this process finished, by status.", ["status"]
)
LAST_FINISHED = Gauge(
    "rtrl_training_run_last_finished_timestamp_seconds",
    "When the latest training run of each status finished (Unix time; from Postgres).",
    ["status"],
)

MERGE_BREAKS = Counter(
    "rtrl_training_merge_breaks_total",
    "Places where a run's turns could not be trained as one sequence: a turn's prompt did "
    "not start with the previous turn's token ids (the client edited or compacted history).",
)

for _status in TrainingRunStatus:
    if _status is not TrainingRunStatus.running:
        RUNS.labels(_status.value)


def record_run(status: TrainingRunStatus, finished_at: datetime, count: int = 1) -> None:
    """Count runs that just finished with `status`."""
    RUNS.labels(status.value).inc(count)
    LAST_FINISHED.labels(status.value).set(finished_at.timestamp())


def load_last_finished(engine: Engine) -> None:
    """Set the latest finish time of each status from the recorded training runs."""
    with session_scope(engine) as session:
        latest = session.execute(
            select(TrainingRun.status, func.max(TrainingRun.finished_at))
            .where(TrainingRun.finished_at.is_not(None))
            .group_by(TrainingRun.status)
        ).all()
    for status, finished_at in latest:
        if finished_at is not None:
            LAST_FINISHED.labels(TrainingRunStatus(status).value).set(finished_at.timestamp())


def record_merge_breaks(count: int) -> None:
    """Count the places a cycle split a run's turns into separate sequences."""
    MERGE_BREAKS.inc(count)
