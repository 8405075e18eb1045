"""Data selection and erasure: an erased user's samples are never trained on."""

from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from app.abtest.assignment import Assignment
from app.db import session_scope
from app.gateway.service import completion_event
from app.gateway.trajectories import Placement
from app.history.erasure import erase_in_database, user_history
from app.models import Checkpoint, CheckpointStatus
from tests.gateway.test_completion_events import answered, call, streamed_tool_calls
from tests.history.conftest import events, history_engine, history_url, served, store
from tests.workers.conftest import Events
from trainer.data import cohort_end, erased_since_selected, select_on_policy_batch

__all__ = ["events", "history_engine", "history_url"]  # the history tests' fixtures

PUBLISHED = datetime(2026, 6, 1, tzinfo=UTC)


def published_production(session: Session, name: str) -> Checkpoint:
    """A production checkpoint published at PUBLISHED, stored."""
    production = Checkpoint(
        name=name, status=CheckpointStatus.production, base_model="tiny", published_at=PUBLISHED
    )
    session.add(production)
    session.flush()
    return production


def test_a_batch_loses_the_samples_of_a_user_erased_while_it_trains(
    history_engine: Engine, events: Events
) -> None:
    for n, user in enumerate(["alice", "bob", "alice"]):
        at = PUBLISHED + timedelta(hours=n + 1)
        store(history_engine, *served(events, n, user, at, checkpoint="ckpt-3"), now=at)
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-3")
        batch = select_on_policy_batch(session, production, max_samples=10)
    assert len(batch.samples) == 3

    with history_engine.begin() as conn:
        erase_in_database(conn, "alice", user_history(conn, "alice"), now=datetime.now(UTC))

    with session_scope(history_engine) as session:
        assert erased_since_selected(session, batch.samples) == 2
        production = session.get_one(Checkpoint, production.id)
        assert len(select_on_policy_batch(session, production, max_samples=10).samples) == 1


def test_a_sample_left_behind_by_an_erasure_is_not_selected(history_engine: Engine) -> None:
    events = Events("late", PUBLISHED)
    for n, at in enumerate([PUBLISHED + timedelta(hours=2), PUBLISHED + timedelta(days=2)]):
        store(history_engine, *served(events, n, "carol", at, checkpoint="ckpt-4"), now=at)
    # Recorded as erased without the rows being deleted, as a writer racing it would leave.
    with history_engine.begin() as conn:
        conn.execute(
            text("INSERT INTO erased_users (user_hash, erased_at) VALUES ('carol', :at)"),
            {"at": PUBLISHED + timedelta(days=1)},
        )
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-4")
        batch = select_on_policy_batch(session, production, max_samples=10)
    # Served before the erasure: never trained on; served after it: the user's new data.
    assert [sample.served_at for sample in batch.samples] == [PUBLISHED + timedelta(days=2)]


def test_a_batch_selected_during_a_burst_of_session_ends_keeps_the_cohorts_kept_share(
    history_engine: Engine,
) -> None:
    """Rejections are final at the session's end, kept edits only at the survival horizon: a
    batch of the newest final samples, taken while a burst of sessions has just ended, is
    mostly rejections. The batch is a cohort by serve time instead."""
    events = Events("burst", PUBLISHED)

    def serve(n: int, at: datetime, kept: bool, now: datetime) -> None:
        timed = Events(events.prefix, at)
        signals = (
            [timed.accepted(n), timed.survival(n, 900, 1.0)]
            if kept
            else [timed.rejected(n), timed.session_end(n)]
        )
        completion = timed.completion(n, checkpoint="ckpt-5", user_hash=f"user-{n}")
        store(history_engine, completion, *signals, now=now)

    day = PUBLISHED + timedelta(days=1)
    for n in range(40):  # yesterday's traffic, half kept: every reward final by now
        serve(n, PUBLISHED + timedelta(hours=1, minutes=n), kept=n % 2 == 0, now=day)
    for n in range(100, 140):  # the last minute: the same mix, only the rejections final yet
        at = day + timedelta(seconds=n - 100)
        timed = Events(events.prefix, at)
        if n % 2 == 0:
            store(
                history_engine, timed.completion(n, checkpoint="ckpt-5"), timed.accepted(n), now=day
            )
        else:
            serve(n, at, kept=False, now=day + timedelta(minutes=1))

    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-5")
        batch = select_on_policy_batch(session, production, max_samples=60)
    kept = [sample.reward > 0.5 for sample in batch.samples]
    # Yesterday's cohort, whole: half kept, as served (the newest 60 final samples were the
    # burst's 20 rejections and 40 of yesterday's: a third kept).
    assert len(batch.samples) == 40 and sum(kept) == 20
    assert batch.window_end is not None and batch.window_end < day


def test_a_run_whose_edit_is_still_open_is_left_out_with_its_final_turns(
    history_engine: Engine,
) -> None:
    """A run's read turn is final at the session's end, but its credit is interim until the
    run's edit is: neither it nor anything served after the run began is trained on yet."""
    start = PUBLISHED + timedelta(hours=3)
    before, read, edit, after = (
        Events("run", start + timedelta(seconds=s)) for s in (0, 10, 20, 30)
    )
    store(
        history_engine,
        before.completion(1, checkpoint="ckpt-6", proposed_edit=False, edit_requested=False),
        before.session_end(1),
        read.completion(
            2, session=9, checkpoint="ckpt-6", proposed_edit=False, trajectory_id="run-r2"
        ),
        edit.completion(3, session=9, checkpoint="ckpt-6", trajectory_id="run-r2", turn_index=1),
        edit.accepted(3, session=9),
        edit.session_end(3, session=9),
        after.completion(4, checkpoint="ckpt-6", proposed_edit=False, edit_requested=False),
        after.session_end(4),
        now=start + timedelta(minutes=5),
    )
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-6")
        assert cohort_end(session, "ckpt-6", PUBLISHED) == read.served_at
        batch = select_on_policy_batch(session, production, max_samples=10)
    assert [sample.served_at for sample in batch.samples] == [before.served_at]


def test_each_sample_keeps_the_state_the_gateway_served_it_in(history_engine: Engine) -> None:
    """What the model saw before it answered, as the gateway logged it and the worker stored
    it: whether the request declared tools, the turn of its run, whether the run asked for an
    edit (the state the trainer's baseline is conditioned on)."""
    at = PUBLISHED + timedelta(hours=1)
    events = Events("state", at)
    agent_turn = completion_event(
        call(session_id=events.session(1), request_id=events.request(1), received_at=at),
        Assignment("ckpt-8"),
        streamed_tool_calls(),
        Placement("state-run", 2, None),
    )
    chat = completion_event(
        call(
            tools=False,
            edit_requested=False,
            session_id=events.session(2),
            request_id=events.request(2),
            received_at=at,
        ),
        Assignment("ckpt-8"),
        answered("What does f do?"),
    )
    store(
        history_engine,
        agent_turn,
        events.accepted(1),
        events.survival(1, 900, 1.0),
        chat,
        events.session_end(2),
        now=at + timedelta(minutes=20),
    )
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-8")
        batch = select_on_policy_batch(session, production, max_samples=10)
    states = {
        (s.tools_declared, s.turn_index, s.edit_requested, s.trajectory_id) for s in batch.samples
    }
    assert states == {(True, 2, True, "state-run"), (False, 0, False, events.request(2))}
