"""Data selection and erasure: an erased user's samples are never trained on."""

import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, select, text, update
from sqlalchemy.orm import Session

from app.abtest.assignment import Assignment
from app.db import session_scope
from app.gateway.service import completion_event
from app.gateway.trajectories import Placement
from app.history.erasure import erase_in_database, user_history
from app.models import Checkpoint, CheckpointStatus, Reward, Sample
from app.signals.rewards import REWARD_OPEN_LIMIT
from tests.gateway.test_completion_events import answered, call, streamed_tool_calls
from tests.history.conftest import events, history_engine, history_url, served, store
from tests.trainer.conftest import KEPT
from tests.workers.conftest import Events
from trainer.data import cohort_end, erased_since_selected, select_on_policy_batch
from workers.config import WorkerConfig
from workers.sweep import finalize_due_rewards

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


def test_an_acceptance_dated_2100_does_not_stop_the_next_cycles_selection(
    history_engine: Engine,
) -> None:
    """Right after a publication, one acceptance dated 2100 on a production completion: its
    reward is due by when the gateway received it, the sweep finalizes it, and the cohort
    moves past it to what was served after."""
    served_at = PUBLISHED + timedelta(hours=1)
    dated = Events("dated", served_at)
    acceptance = dated.accepted(1).model_copy(
        update={
            "occurred_at": datetime(2100, 1, 1, tzinfo=UTC),
            "received_at": served_at + timedelta(seconds=5),
        }
    )
    store(history_engine, dated.completion(1, checkpoint="ckpt-9"), acceptance, now=served_at)
    later = served_at + timedelta(minutes=10)
    store(history_engine, *served(dated, 2, "user-2", later, checkpoint="ckpt-9"), now=later)
    bound = served_at + REWARD_OPEN_LIMIT
    with history_engine.connect() as conn:
        due_at = conn.execute(select(Reward.due_at).order_by(Reward.served_at)).scalars().first()
    assert due_at is not None and due_at <= bound

    finalize_due_rewards(history_engine, WorkerConfig(), now=bound)
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-9")
        assert cohort_end(session, "ckpt-9", PUBLISHED) is None
        batch = select_on_policy_batch(session, production, max_samples=10)
    assert later in [sample.served_at for sample in batch.samples]


def test_a_reward_stored_due_in_2100_does_not_end_the_cohort(history_engine: Engine) -> None:
    """A due time no worker sets now (past the reward's bound): the cohort does not wait for
    it, and the rest of what the checkpoint served is trained on."""
    served_at = PUBLISHED + timedelta(hours=1)
    stuck = Events("stuck", served_at)
    store(
        history_engine,
        stuck.completion(1, checkpoint="ckpt-10"),
        stuck.accepted(1),
        now=served_at,
    )
    with history_engine.begin() as conn:
        conn.execute(update(Reward).values(due_at=datetime(2100, 1, 1, 0, 17, tzinfo=UTC)))
    later = served_at + timedelta(minutes=10)
    store(history_engine, *served(stuck, 2, "user-2", later, checkpoint="ckpt-10"), now=later)
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-10")
        assert cohort_end(session, "ckpt-10", PUBLISHED) is None
        batch = select_on_policy_batch(session, production, max_samples=10)
    assert [sample.served_at for sample in batch.samples] == [later]


def trainable(
    session: Session, checkpoint: str, served_at: datetime, *, key: uuid.UUID | None, user: str
) -> None:
    """A finalized, trainable sample of `checkpoint`, served to `key` and `user`."""
    sample = Sample(
        event_id=uuid.uuid4(),
        request_id=f"share-{uuid.uuid4().hex}",
        session_id="share",
        user_hash=user,
        api_key_id=key,
        checkpoint=checkpoint,
        privacy=False,
        trainable=True,
        edit_requested=True,
        proposed_edit=True,
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        behaviour_logprobs=[-1.0, -1.0],
        status="ok",
        ttft_ms=1.0,
        latency_ms=2.0,
        served_at=served_at,
    )
    session.add(sample)
    session.flush()
    session.add(
        Reward(
            sample_id=sample.id,
            served_at=served_at,
            components=KEPT.model_dump(mode="json"),
            reward=1.0,
            reward_version=1,
            due_at=served_at,
            finalized_at=served_at,
            finalize_reason="horizon",
        )
    )


def test_no_key_and_no_user_fills_more_than_its_share_of_a_batch(history_engine: Engine) -> None:
    """Just before a cycle one key floods the gateway under many user ids, and one user sends
    much through their key: each gives the batch only its newest share of it."""
    flooding, busy, quiet = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    start = PUBLISHED + timedelta(hours=1)
    with session_scope(history_engine) as session:
        production = published_production(session, "ckpt-11")
        for n in range(4):  # two quiet users, earlier in the day
            trainable(session, "ckpt-11", start + timedelta(minutes=n), key=quiet, user=f"q{n % 2}")
        for n in range(6):  # one busy user
            trainable(session, "ckpt-11", start + timedelta(hours=1, minutes=n), key=busy, user="b")
        for n in range(40):  # the flood, newest of all, a fresh user id each time
            at = start + timedelta(hours=2, seconds=n)
            trainable(session, "ckpt-11", at, key=flooding, user=f"f{n}")
        for n in range(3):  # logged before keys were recorded
            trainable(session, "ckpt-11", start - timedelta(minutes=n + 1), key=None, user=f"o{n}")
        session.flush()

        batch = select_on_policy_batch(session, production, max_samples=12, max_share=0.25)
        rows = session.execute(
            select(Sample.api_key_id, Sample.user_hash).where(
                Sample.id.in_([s.sample_id for s in batch.samples])
            )
        ).all()
    by_key = Counter(row.api_key_id for row in rows if row.api_key_id is not None)
    by_user = Counter(row.user_hash for row in rows)
    # A share of 0.25 of 12: three samples a key and three a user, each source's newest.
    assert by_key == {flooding: 3, busy: 3, quiet: 3}
    assert max(by_user.values()) == by_user["b"] == 3
    assert len(batch.samples) == 12  # the keyless samples fill the rest
    newest = sorted((s.served_at for s in batch.samples), reverse=True)
    assert [s.served_at for s in batch.samples] == newest

    with session_scope(history_engine) as session:
        production = session.get_one(Checkpoint, production.id)
        whole = select_on_policy_batch(session, production, max_samples=12, max_share=1.0)
    assert len(whole.samples) == 12  # no cap: the newest twelve, all of the flood
    assert all(s.served_at >= start + timedelta(hours=2) for s in whole.samples)
