"""Data selection and erasure: an erased user's samples are never trained on."""

from datetime import UTC, datetime, timedelta

from sqlalchemy import Engine, text

from app.db import session_scope
from app.history.erasure import erase_in_database, user_history
from app.models import Checkpoint, CheckpointStatus
from tests.history.conftest import events, history_engine, history_url, served, store
from tests.workers.conftest import Events
from trainer.data import erased_since_selected, select_on_policy_batch

__all__ = ["events", "history_engine", "history_url"]  # the history tests' fixtures

PUBLISHED = datetime(2026, 6, 1, tzinfo=UTC)


def test_a_batch_loses_the_samples_of_a_user_erased_while_it_trains(
    history_engine: Engine, events: Events
) -> None:
    for n, user in enumerate(["alice", "bob", "alice"]):
        at = PUBLISHED + timedelta(hours=n + 1)
        store(history_engine, *served(events, n, user, at, checkpoint="ckpt-3"), now=at)
    with session_scope(history_engine) as session:
        production = Checkpoint(
            name="ckpt-3",
            status=CheckpointStatus.production,
            base_model="tiny",
            published_at=PUBLISHED,
        )
        session.add(production)
        session.flush()
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
        production = Checkpoint(
            name="ckpt-4",
            status=CheckpointStatus.production,
            base_model="tiny",
            published_at=PUBLISHED,
        )
        session.add(production)
        session.flush()
        batch = select_on_policy_batch(session, production, max_samples=10)
    # Served before the erasure: never trained on; served after it: the user's new data.
    assert [sample.served_at for sample in batch.samples] == [PUBLISHED + timedelta(days=2)]
