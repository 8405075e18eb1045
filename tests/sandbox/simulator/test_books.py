"""The books of simulated traffic, read from Postgres: which answers ended with a reward."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime
from uuid import uuid4

import pytest
from sqlalchemy import Engine, delete

from app.db import session_scope
from app.models import Reward, Sample
from app.signals.rewards import RewardComponents
from sandbox.simulator.books import read_books, read_final_books
from sandbox.simulator.report import ServedRequest, SimulationReport


@pytest.fixture
def session_id(engine: Engine) -> Iterator[str]:
    """A session of stored samples, deleted (with their rewards) after the test."""
    session_id = f"books-{uuid4().hex}"
    yield session_id
    with session_scope(engine) as session:
        session.execute(delete(Sample).where(Sample.session_id == session_id))


def components(
    *, proposed_edit: bool, accepted: bool | None, kept: float | None
) -> RewardComponents:
    return RewardComponents(
        edit_requested=True,
        proposed_edit=proposed_edit,
        accepted=accepted,
        kept=kept,
        survival_elapsed_s=None if kept is None else 900.0,
        dissatisfied=None,
        latency_ms=5.0,
        latency_over_budget=False,
        malformed_tool_calls=0,
        status="ok",
    )


def store(
    engine: Engine,
    session_id: str,
    request_id: str,
    parts: RewardComponents,
    reward: float | None,
    final: bool,
) -> None:
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        sample = Sample(
            event_id=uuid4(),
            request_id=request_id,
            session_id=session_id,
            user_hash="u",
            checkpoint="books-test",
            privacy=False,
            trainable=False,
            edit_requested=True,
            proposed_edit=parts.proposed_edit,
            prompt_token_ids=[1, 2],
            completion_token_ids=[3],
            behaviour_logprobs=[-1.0],
            status="ok",
            ttft_ms=1.0,
            latency_ms=5.0,
            served_at=now,
        )
        session.add(sample)
        session.flush()
        session.add(
            Reward(
                sample_id=sample.id,
                components=parts.model_dump(mode="json"),
                reward=reward,
                reward_version=5,
                due_at=now,
                finalized_at=now if final else None,
                finalize_reason="timeout" if final else None,
            )
        )


def served(
    session_id: str, request_id: str, accepted: bool | None, reported: bool
) -> ServedRequest:
    return ServedRequest(
        request_id=request_id,
        session_id=session_id,
        user_id="sim-0-00000",
        task_id="t",
        checkpoint="base",
        latency_s=0.005,
        proposed_edit=True,
        accepted=accepted,
        verdict_reported=reported,
    )


def test_the_books_count_the_answers_that_ended_with_a_reward_and_what_their_edits_kept(
    engine: Engine, session_id: str
) -> None:
    ids = [f"books-{uuid4().hex}" for _ in range(5)]
    store(
        engine,
        session_id,
        ids[0],
        components(proposed_edit=True, accepted=True, kept=0.9),
        0.9,
        True,
    )
    store(
        engine,
        session_id,
        ids[1],
        components(proposed_edit=True, accepted=False, kept=0.0),
        -0.5,
        True,
    )
    # An edit nobody reported on: final, but without a reward.
    store(
        engine,
        session_id,
        ids[2],
        components(proposed_edit=True, accepted=None, kept=None),
        None,
        True,
    )
    store(
        engine,
        session_id,
        ids[3],
        components(proposed_edit=False, accepted=None, kept=0.0),
        0.0,
        True,
    )
    store(
        engine,
        session_id,
        ids[4],
        components(proposed_edit=True, accepted=None, kept=None),
        None,
        False,
    )
    report = SimulationReport(client="stock")
    for request_id in ids:
        # The developer liked every edit; only a stock client, which told nobody.
        report.record_served(served(session_id, request_id, True, reported=False))

    books = read_books(engine, [report])

    tally = books.rewards
    assert (tally.served, tally.finalized, tally.rewarded, tally.rewarded_edits) == (5, 4, 3, 2)
    assert tally.rewarded_share == 3 / 5
    assert abs(tally.kept_share - 0.45) < 1e-9
    assert books.unfinalized == [ids[4]]
    assert books.wrong_verdicts == [], "verdicts the client never reported are not compared"


def test_waiting_for_final_books_gives_up_at_the_timeout(engine: Engine, session_id: str) -> None:
    request_id = f"books-{uuid4().hex}"
    store(
        engine,
        session_id,
        request_id,
        components(proposed_edit=True, accepted=None, kept=None),
        None,
        False,
    )
    report = SimulationReport()
    report.record_served(served(session_id, request_id, None, reported=True))

    started = time.monotonic()
    books = read_final_books(engine, [report], timeout_s=0.3, poll_s=0.1)

    assert books.unfinalized == [request_id]
    assert time.monotonic() - started < 5
