"""Reward-hacking monitors: a seeded canary/control difference alerts, a tiny window does not."""

from datetime import timedelta
from typing import Any

from prometheus_client import REGISTRY
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from app.models import Alert, Arm, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from workers.config import WorkerConfig
from workers.monitors import (
    DEFAULT_THRESHOLDS,
    Threshold,
    Window,
    check_monitors,
    check_running_experiments,
    measure,
)
from workers.store import feedback_row, sample_row, store_events

CONFIG = WorkerConfig()


def seed(
    engine: Engine,
    events: Any,
    checkpoint: str,
    first: int,
    count: int,
    *,
    asks_every: int,
    experiment_id: int | None = None,
) -> None:
    """`count` samples of `checkpoint`; one in `asks_every` is a clarifying question."""
    completions = [
        events.completion(
            n,
            checkpoint=checkpoint,
            experiment_id=experiment_id,
            clarifying_question=n % asks_every == 0,
            proposed_edit=n % asks_every != 0,
            completion_tokens=100,
        )
        for n in range(first, first + count)
    ]
    followups = [events.followup(n, "thanks, that fixed it") for n in range(first, first + count)]
    with engine.begin() as conn:
        store_events(
            conn,
            [sample_row(e) for e in completions],
            [feedback_row(e) for e in followups],
            CONFIG,
            now=events.served_at,
        )


def alerts_counted() -> dict[str, float]:
    """What Prometheus reads of rtrl_reward_hacking_alerts_total, by metric."""
    return {
        metric: REGISTRY.get_sample_value("rtrl_reward_hacking_alerts_total", {"metric": metric})
        or 0.0
        for metric in DEFAULT_THRESHOLDS
    }


def window_around(events: Any) -> Window:
    return Window(events.served_at - timedelta(minutes=1), events.served_at + timedelta(minutes=1))


def test_a_canary_that_asks_instead_of_answering_raises_an_alert(
    worker_engine: Engine, events: Any
) -> None:
    canary, control = f"{events.prefix}-canary", f"{events.prefix}-control"
    seed(worker_engine, events, control, 0, 300, asks_every=20)
    seed(worker_engine, events, canary, 1000, 300, asks_every=3)
    thresholds = DEFAULT_THRESHOLDS | {
        "clarifying_question_rate": Threshold(absolute=0.05, min_samples=100)
    }
    counted = alerts_counted()

    alerts = check_monitors(
        worker_engine,
        canary=canary,
        control=control,
        window=window_around(events),
        thresholds=thresholds,
    )

    assert sorted(a.metric for a in alerts) == ["clarifying_question_rate", "edit_rate"]
    asks = next(a for a in alerts if a.metric == "clarifying_question_rate")
    assert round(asks.canary_value, 3) == round(100 / 300, 3)
    assert asks.control_value == 15 / 300
    assert asks.threshold == 0.05
    with worker_engine.connect() as conn:
        stored = conn.execute(select(Alert.metric).where(Alert.checkpoint == canary)).scalars()
        assert sorted(stored) == ["clarifying_question_rate", "edit_rate"]
        metrics = measure(conn, [canary, control], window_around(events))
    assert metrics[canary]["mean_completion_tokens"].value == 100
    assert metrics[canary]["dissatisfied_rate"].value == 0.0
    assert metrics[canary]["dissatisfied_rate"].observations == 300

    again = check_monitors(
        worker_engine,
        canary=canary,
        control=control,
        window=window_around(events),
        thresholds=thresholds,
    )
    assert again == []  # already alerted for this window
    raised = {metric: n - counted[metric] for metric, n in alerts_counted().items()}
    assert raised == {
        m: 1.0 if m in ("clarifying_question_rate", "edit_rate") else 0.0 for m in raised
    }


def test_a_canary_that_asks_less_than_control_is_learning_not_hacking(
    worker_engine: Engine, events: Any
) -> None:
    canary, control = f"{events.prefix}-canary", f"{events.prefix}-control"
    seed(worker_engine, events, control, 0, 300, asks_every=3)
    seed(worker_engine, events, canary, 1000, 300, asks_every=20)
    thresholds = DEFAULT_THRESHOLDS | {
        "clarifying_question_rate": Threshold(absolute=0.05, min_samples=100, harmful="up")
    }

    alerts = check_monitors(
        worker_engine,
        canary=canary,
        control=control,
        window=window_around(events),
        thresholds=thresholds,
    )

    # Fewer questions and more edits than control: both differences beyond their
    # thresholds, neither in the harmful direction.
    assert alerts == []


def test_a_tiny_window_does_not_alert(worker_engine: Engine, events: Any) -> None:
    canary, control = f"{events.prefix}-canary", f"{events.prefix}-control"
    seed(worker_engine, events, control, 0, 20, asks_every=20)
    seed(worker_engine, events, canary, 1000, 20, asks_every=2)

    alerts = check_monitors(
        worker_engine, canary=canary, control=control, window=window_around(events)
    )

    assert alerts == []
    with worker_engine.connect() as conn:
        assert conn.execute(select(Alert).where(Alert.checkpoint == canary)).all() == []


def test_the_worker_checks_every_running_experiment_against_its_control_arm(
    worker_engine: Engine, events: Any
) -> None:
    canary, control = f"{events.prefix}-canary", f"{events.prefix}-control"
    with Session(worker_engine) as session, session.begin():
        checkpoints = [
            Checkpoint(name=name, status=CheckpointStatus.candidate, base_model="tiny")
            for name in (control, canary)
        ]
        experiment = Experiment(
            name=events.prefix, route=events.prefix, salt="s", status=ExperimentStatus.running
        )
        session.add_all([*checkpoints, experiment])
        session.flush()
        experiment.arms = [
            Arm(name="control", checkpoint_id=checkpoints[0].id, weight_bps=9000, is_control=True),
            Arm(name="canary", checkpoint_id=checkpoints[1].id, weight_bps=1000),
        ]
        experiment_id = experiment.id
    seed(worker_engine, events, control, 0, 250, asks_every=50, experiment_id=experiment_id)
    seed(worker_engine, events, canary, 1000, 250, asks_every=50, experiment_id=experiment_id)
    seed(worker_engine, events, canary, 2000, 250, asks_every=2)  # outside the experiment
    try:
        alerts = check_running_experiments(
            worker_engine,
            window_length=timedelta(minutes=5),
            thresholds={"clarifying_question_rate": Threshold(absolute=0.05, min_samples=100)},
            now=events.served_at + timedelta(minutes=1),
        )
        assert [a for a in alerts if a.checkpoint == canary] == []

        seed(worker_engine, events, canary, 3000, 250, asks_every=3, experiment_id=experiment_id)
        alerts = check_running_experiments(
            worker_engine,
            window_length=timedelta(minutes=5),
            thresholds={"clarifying_question_rate": Threshold(absolute=0.05, min_samples=100)},
            now=events.served_at + timedelta(minutes=1),
        )
        mine = [a for a in alerts if a.checkpoint == canary]
        assert [(a.metric, a.control_checkpoint) for a in mine] == [
            ("clarifying_question_rate", control)
        ]
    finally:
        with Session(worker_engine) as session, session.begin():
            session.get_one(Experiment, experiment_id).status = ExperimentStatus.stopped
