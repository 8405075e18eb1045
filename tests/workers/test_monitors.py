"""Reward-hacking monitors: a seeded canary/control difference alerts, a tiny window does not,
and equal checkpoints seldom do (an A/A run through the decision rule)."""

from datetime import timedelta
from typing import Any

import numpy as np
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
    exceeded,
    measure,
    measurement,
)
from workers.store import feedback_row, sample_row, store_events

CONFIG = WorkerConfig()
USERS = 25


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
    """`count` samples of `checkpoint` from `USERS` developers; one in `asks_every` is a
    clarifying question."""
    completions = [
        events.completion(
            n,
            checkpoint=checkpoint,
            user_hash=f"u{events.prefix}-{n % USERS}",
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
    estimate = metrics[canary]["dissatisfied_rate"].estimate
    assert estimate is not None and estimate.users == USERS  # the unit is the developer

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


def a_line_of_three(engine: Engine, prefix: str) -> tuple[int, int]:
    """Checkpoints root -> control -> canary; an earlier, stopped experiment served the root,
    a running one splits control and canary. Returns the two experiments' ids."""
    with Session(engine) as session, session.begin():
        root = Checkpoint(name=f"{prefix}-root", status=CheckpointStatus.retired, base_model="t")
        control = Checkpoint(
            name=f"{prefix}-control", status=CheckpointStatus.candidate, base_model="t", parent=root
        )
        canary = Checkpoint(
            name=f"{prefix}-canary", status=CheckpointStatus.canary, base_model="t", parent=control
        )
        earlier, running = (
            Experiment(name=f"{prefix}-{n}", route=prefix, salt="s", status=status)
            for n, status in ((1, ExperimentStatus.stopped), (2, ExperimentStatus.running))
        )
        session.add_all([root, control, canary, earlier, running])
        session.flush()
        earlier.arms = [
            Arm(name="control", checkpoint_id=root.id, weight_bps=10000, is_control=True)
        ]
        running.arms = [
            Arm(name="control", checkpoint_id=control.id, weight_bps=5000, is_control=True),
            Arm(name="canary", checkpoint_id=canary.id, weight_bps=5000),
        ]
        return earlier.id, running.id


def stop_experiment(engine: Engine, experiment_id: int) -> None:
    with Session(engine) as session, session.begin():
        session.get_one(Experiment, experiment_id).status = ExperimentStatus.stopped


def alerts_on_canary(engine: Engine, events: Any, **options: Any) -> list[Alert]:
    alerts = check_running_experiments(
        engine,
        window_length=timedelta(minutes=5),
        thresholds={"clarifying_question_rate": Threshold(absolute=0.05, min_samples=100)},
        now=events.served_at + timedelta(minutes=1),
        **options,
    )
    return [a for a in alerts if a.checkpoint == f"{events.prefix}-canary"]


def test_a_canary_level_with_its_control_but_far_from_its_root_alerts_against_the_root(
    worker_engine: Engine, events: Any
) -> None:
    """A hack that creeps: each update a little further, never clear of its own control."""
    root, control, canary = (f"{events.prefix}-{n}" for n in ("root", "control", "canary"))
    earlier, running = a_line_of_three(worker_engine, events.prefix)
    try:
        # The root's A/B traffic asked one time in 20; outside experiments it asked every
        # other time, which the comparison must not read.
        seed(worker_engine, events, root, 0, 300, asks_every=20, experiment_id=earlier)
        seed(worker_engine, events, root, 1000, 300, asks_every=2)
        seed(worker_engine, events, control, 2000, 300, asks_every=6, experiment_id=running)
        seed(worker_engine, events, canary, 3000, 300, asks_every=6, experiment_id=running)

        alerts = alerts_on_canary(worker_engine, events)

        assert [(a.metric, a.control_checkpoint) for a in alerts] == [
            ("clarifying_question_rate", root)
        ]
        assert alerts[0].canary_value == 50 / 300 and alerts[0].control_value == 15 / 300
        assert alerts_on_canary(worker_engine, events) == []  # already alerted for this window
    finally:
        stop_experiment(worker_engine, running)


def test_a_root_served_in_no_experiment_within_the_lookback_gives_no_verdict(
    worker_engine: Engine, events: Any
) -> None:
    earlier, running = a_line_of_three(worker_engine, events.prefix)
    try:
        seed(
            worker_engine,
            events,
            f"{events.prefix}-root",
            0,
            300,
            asks_every=20,
            experiment_id=earlier,
        )
        seed(
            worker_engine,
            events,
            f"{events.prefix}-canary",
            3000,
            300,
            asks_every=6,
            experiment_id=running,
        )
        # The root's traffic is a minute old; the lookback is 30 s.
        assert (
            alerts_on_canary(worker_engine, events, reference_lookback=timedelta(seconds=30)) == []
        )
    finally:
        stop_experiment(worker_engine, running)


def malformed_per_user(
    rng: np.random.Generator, users: int, malformed_share: float, answers: tuple[int, int]
) -> list[tuple[float, float]]:
    """(responses with a malformed call, responses with calls) of each developer, with
    `answers` (low, high) tool-calling answers each; developers differ (their tasks, their
    sessions), so the share varies between them more than coin flips would."""
    counts = rng.integers(answers[0], answers[1] + 1, size=users)
    shares = rng.beta(2, 2 * (1 - malformed_share) / malformed_share, size=users)
    return [(float(rng.binomial(n, p)), float(n)) for n, p in zip(counts, shares, strict=True)]


def alerting(
    rng: np.random.Generator,
    canary: tuple[int, float, tuple[int, int]],
    control: tuple[int, float, tuple[int, int]],
    threshold: Threshold,
    trials: int,
) -> int:
    """How many of `trials` simulated pairs alert; each side is (developers, share, answers)
    of `malformed_per_user`."""
    return sum(
        exceeded(
            measurement(malformed_per_user(rng, *canary)),
            measurement(malformed_per_user(rng, *control)),
            threshold,
        )
        is not None
        for _ in range(trials)
    )


def test_equal_checkpoints_seldom_alert_and_a_hacked_one_nearly_always_does() -> None:
    rng = np.random.default_rng(11)
    threshold = DEFAULT_THRESHOLDS["malformed_call_rate"]
    assert threshold.absolute is not None
    # A/A at the learning demo's evaluation: 20 developers an arm, 3 to 9 tool-calling
    # answers each (min_samples lowered to let the rule decide on about 120 a side).
    small = Threshold(absolute=threshold.absolute, min_samples=100, harmful="up")
    trials = 400
    alerts = point_estimate_alerts = 0
    for _ in range(trials):
        canary = measurement(malformed_per_user(rng, 20, 0.1, (3, 9)))
        control = measurement(malformed_per_user(rng, 20, 0.1, (3, 9)))
        alerts += exceeded(canary, control, small) is not None
        assert canary.value is not None and control.value is not None
        point_estimate_alerts += canary.value - control.value > threshold.absolute
    # The interval over users leaves about 2.5% in the harmful direction (1.8% of 2,000
    # such trials); the threshold on the point estimates alone alerted on 30.9% of them.
    assert alerts / trials < 0.05
    assert point_estimate_alerts / trials > 0.2

    # The reward-hacking test's canary (tests/rtrl/test_demo.py): 38% of its tool-calling
    # answers malformed against control's 20%, 48 developers an arm with about 11 answers
    # each, at the default threshold (caught in 99% of 1,000 such runs; 93% at 32 an arm).
    caught = alerting(rng, (48, 0.38, (8, 14)), (48, 0.20, (8, 14)), threshold, 200)
    assert caught >= 190


def test_the_root_comparison_seldom_alerts_on_an_equal_root_and_mostly_catches_a_creep() -> None:
    """The root comparison's groups are unequal: a canary's evaluation (about 24 developers)
    against the root's earlier evaluations pooled (about 50). Simulated without the one thing
    it adds, traffic that changes between the periods, which no simulation here has."""
    rng = np.random.default_rng(12)
    malformed = DEFAULT_THRESHOLDS["malformed_call_rate"]
    questions = DEFAULT_THRESHOLDS["clarifying_question_rate"]
    small = Threshold(absolute=malformed.absolute, min_samples=100, harmful="up")
    trials = 1000
    alerts = alerting(rng, (24, 0.15, (6, 12)), (50, 0.15, (6, 12)), small, trials)
    assert alerts / trials < 0.05  # 1.3% here, 1.6% of 2,000 such pairs

    # The creep the reward-hacking scenario's first AVX-512 run showed: 13.7% of the
    # canary's answers questions against the root's 6.1%, 22 developers against 50, about
    # 12 answers each.
    caught = alerting(rng, (22, 0.137, (10, 14)), (50, 0.061, (10, 14)), questions, 400)
    assert caught / 400 > 0.6  # 70.5% here, 72% of 2,000 such runs
