"""Client-set times and floods of feedback against the workers and Postgres: a reward is due
by its bound whatever its events say, an instant horizon report mints nothing, and a request
id with thousands of stored events is distilled from a bounded read."""

from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, select, update

from app.events import EditAccepted, EditSurvival, FollowupMessage
from app.signals.rewards import FEEDBACK_CLOCK_SKEW_S, Feedback, reward_open_limit
from tests.history.conftest import history_engine, history_url, store
from tests.workers.conftest import Events
from workers.config import WorkerConfig
from workers.repository import FEEDBACK_ROWS_PER_KIND, load_feedback_signals, rewards, samples
from workers.store import feedback_row, sample_row, store_events
from workers.sweep import finalize_due_rewards, overdue_seconds

__all__ = ["history_engine", "history_url"]  # the history tests' fixtures

CONFIG = WorkerConfig()
OPEN_LIMIT = reward_open_limit(horizon_s=CONFIG.horizon_s, grace_s=CONFIG.grace_s)
FAR_FUTURE = datetime(2100, 1, 1, tzinfo=UTC)


def stamped(event: Feedback, received_after_s: float, events: Events, **fields: Any) -> Any:
    """The event as a gateway stamps it, `received_after_s` after the completion was served."""
    received_at = events.served_at + timedelta(seconds=received_after_s)
    return event.model_copy(update={"received_at": received_at, **fields})


def store_in(conn: Connection, *batch: Any, now: datetime) -> None:
    completions = [e for e in batch if e.__class__.__name__ == "CompletionEvent"]
    feedback = [e for e in batch if e not in completions]
    store_events(
        conn,
        [sample_row(e) for e in completions],
        [feedback_row(e) for e in feedback],
        CONFIG,
        now=now,
    )


def reward_of(conn: Connection, request_id: str) -> Any:
    return conn.execute(
        select(rewards)
        .join(samples, samples.c.id == rewards.c.sample_id)
        .where(samples.c.request_id == request_id)
    ).one()


def ignored_reports() -> float:
    return REGISTRY.get_sample_value("rtrl_survival_reports_ignored_total") or 0.0


def test_an_instant_horizon_report_finalizes_no_maximal_reward(
    conn: Connection, events: Events
) -> None:
    """Accepted, then one second later "900 s on, all of it survived": that window had not
    passed, so the report is left out (and counted once) and the reward waits."""
    before = ignored_reports()
    acceptance = stamped(events.accepted(1, after_s=5), 5, events)
    instant = stamped(events.survival(1, 900, 1.0), 6, events)
    store_in(conn, events.completion(1), acceptance, instant, now=acceptance.received_at)
    store_in(conn, instant, now=instant.received_at)  # redelivered: counted once

    reward = reward_of(conn, events.request(1))
    assert reward.finalized_at is None
    assert reward.components["survival_elapsed_s"] == 0.0  # the acceptance's own window
    assert reward.components["survival_reports_ignored"] == 1
    assert ignored_reports() == before + 1
    assert reward.due_at == events.served_at + timedelta(seconds=5) + (
        CONFIG.survival_horizon + CONFIG.finalization_grace
    )

    # The real horizon report, received when 900 s have passed, settles it.
    real = stamped(events.survival(1, 900, 0.5), 910, events)
    store_in(conn, real, now=real.received_at)
    reward = reward_of(conn, events.request(1))
    assert (reward.finalize_reason, reward.components["kept"]) == ("horizon", 0.5)


def test_an_instant_report_after_a_backdated_acceptance_is_left_out(
    conn: Connection, events: Events
) -> None:
    acceptance = stamped(
        events.accepted(1), 1, events, occurred_at=events.served_at - timedelta(days=3)
    )
    instant = stamped(events.survival(1, 900, 1.0), 2, events)
    store_in(conn, events.completion(1), acceptance, instant, now=instant.received_at)
    reward = reward_of(conn, events.request(1))
    assert reward.finalized_at is None
    assert reward.components["survival_reports_ignored"] == 1
    # Read at the serve time, not three days before it.
    assert reward.due_at == events.served_at + CONFIG.survival_horizon + CONFIG.finalization_grace


def test_an_acceptance_dated_2100_is_due_by_its_receipt_and_finalized_by_the_sweep(
    conn: Connection, events: Events
) -> None:
    acceptance = stamped(events.accepted(1), 5, events, occurred_at=FAR_FUTURE)
    store_in(conn, events.completion(1), acceptance, now=acceptance.received_at)
    due = (
        events.served_at
        + timedelta(seconds=5 + FEEDBACK_CLOCK_SKEW_S)
        + CONFIG.survival_horizon
        + CONFIG.finalization_grace
    )
    assert reward_of(conn, events.request(1)).due_at == due

    finalize_due_rewards(conn, CONFIG, now=due)
    reward = reward_of(conn, events.request(1))
    assert (reward.finalize_reason, reward.finalized_at) == ("timeout", due)


def test_an_unstamped_acceptance_dated_2100_is_censored_at_the_bound(
    conn: Connection, events: Events
) -> None:
    """An event queued before gateways stamped receipts is taken as sent, but no reward is
    due later than its bound: there the sweep finalizes it as censored."""
    acceptance = EditAccepted(
        session_id=events.session(1), request_id=events.request(1), occurred_at=FAR_FUTURE
    )
    store_in(conn, events.completion(1), acceptance, now=events.served_at)
    bound = events.served_at + OPEN_LIMIT
    assert reward_of(conn, events.request(1)).due_at == bound

    finalize_due_rewards(conn, CONFIG, now=bound - timedelta(seconds=1))
    assert reward_of(conn, events.request(1)).finalized_at is None
    finalize_due_rewards(conn, CONFIG, now=bound)
    reward = reward_of(conn, events.request(1))
    assert (reward.finalize_reason, reward.finalized_at) == ("censored", bound)


def test_a_reward_stored_due_in_2100_is_swept_once_its_bound_has_passed(
    conn: Connection, events: Events
) -> None:
    """A due time no worker sets now (stored before due times were bounded) is not waited for."""
    store_in(conn, events.completion(1), events.accepted(1), now=events.served_at)
    conn.execute(
        update(rewards)
        .where(rewards.c.sample_id == reward_of(conn, events.request(1)).sample_id)
        .values(due_at=FAR_FUTURE)
    )
    bound = events.served_at + OPEN_LIMIT
    finalize_due_rewards(conn, CONFIG, now=bound - timedelta(seconds=1))
    assert reward_of(conn, events.request(1)).finalized_at is None

    finalize_due_rewards(conn, CONFIG, now=bound)
    reward = reward_of(conn, events.request(1))
    assert reward.finalize_reason == "timeout"  # due, distilled again, at acceptance + 17 min
    assert reward.finalized_at == bound


def test_a_workers_sweep_takes_a_reward_due_in_2100_once_its_partition_is_read_past_the_bound(
    conn: Connection, events: Events
) -> None:
    completion = sample_row(events.completion(1)) | {"kafka_partition": 3}
    store_events(
        conn, [completion], [feedback_row(events.accepted(1))], CONFIG, now=events.served_at
    )
    conn.execute(
        update(rewards)
        .where(rewards.c.sample_id == reward_of(conn, events.request(1)).sample_id)
        .values(due_at=FAR_FUTURE)
    )
    bound = events.served_at + OPEN_LIMIT
    late = bound + timedelta(hours=1)
    # Read only to before the bound (a lagging partition), or another worker's: not yet.
    finalize_due_rewards(conn, CONFIG, now=late, watermarks={3: bound - timedelta(seconds=1)})
    finalize_due_rewards(conn, CONFIG, now=late, watermarks={2: late})
    assert reward_of(conn, events.request(1)).finalized_at is None

    finalize_due_rewards(conn, CONFIG, now=late, watermarks={3: bound})
    assert reward_of(conn, events.request(1)).finalize_reason == "timeout"


def test_the_overdue_measure_counts_a_reward_due_in_2100_by_its_age(
    history_engine: Engine, events: Events
) -> None:
    served_at = datetime(2026, 1, 1, 12, tzinfo=UTC)
    timed = Events(events.prefix, served_at)
    store(history_engine, timed.completion(1), timed.accepted(1), now=served_at)
    with history_engine.begin() as conn:
        conn.execute(update(rewards).values(due_at=FAR_FUTURE))
    ten_minutes_late = served_at + OPEN_LIMIT + timedelta(minutes=10)
    assert overdue_seconds(history_engine, ten_minutes_late) == 600.0
    assert overdue_seconds(history_engine, served_at + OPEN_LIMIT) == 0.0


def test_a_request_flooded_with_events_is_distilled_from_a_bounded_read(
    conn: Connection, events: Events
) -> None:
    """Thousands of events stored on one request id after its honest feedback (past the
    gateway's limits, or from before them): each batch that touches it reads the first
    received of each kind, and its reward is the one its honest feedback earned."""

    def honest(n: int) -> list[Any]:
        return [
            events.completion(n),
            events.accepted(n),
            events.survival(n, 120, 0.9),
            events.survival(n, 900, 0.8),
            events.followup(n, "thanks, works"),
        ]

    store_in(conn, *honest(1), *honest(2), now=events.served_at)
    flood_received_at = events.served_at + timedelta(minutes=20)
    flood: list[Any] = [
        FollowupMessage(
            session_id=events.session(1),
            request_id=events.request(1),
            occurred_at=events.served_at + timedelta(seconds=40 + n),
            received_at=flood_received_at,
            message="still broken, revert that",
        )
        for n in range(3000)
    ] + [
        EditSurvival(
            session_id=events.session(1),
            request_id=events.request(1),
            occurred_at=events.served_at + timedelta(seconds=300),
            received_at=flood_received_at,
            elapsed_s=295,
            surviving_share=0.0,
        )
        for _ in range(3000)
    ]
    store_in(conn, *flood, now=flood_received_at)

    read = load_feedback_signals(conn, [events.request(1)], [events.session(1)])
    assert len(read) <= 4 * FEEDBACK_ROWS_PER_KIND
    flooded, alone = reward_of(conn, events.request(1)), reward_of(conn, events.request(2))
    assert flooded.components == alone.components
    assert (flooded.components["kept"], flooded.components["dissatisfied"]) == (0.8, False)
