"""The worker's Postgres handlers as plain functions: no broker, one rolled-back transaction."""

import dataclasses
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, select

from app.events import CompletionEvent
from app.history.erasure import erase_in_database, user_history
from app.signals.rewards import compute_reward, distil_components, reward_weights
from workers.config import WorkerConfig
from workers.repository import feedback_events, rewards, samples, unstorable
from workers.store import feedback_row, sample_row, store_events

CONFIG = WorkerConfig()


def store(conn: Connection, *events: Any) -> None:
    completions = [e for e in events if isinstance(e, CompletionEvent)]
    feedback = [e for e in events if not isinstance(e, CompletionEvent)]
    store_events(
        conn,
        [sample_row(e) for e in completions],
        [feedback_row(e) for e in feedback],
        CONFIG,
        now=datetime.now(UTC),
    )


def reward_of(conn: Connection, request_id: str) -> Any:
    return conn.execute(
        select(rewards)
        .join(samples, samples.c.id == rewards.c.sample_id)
        .where(samples.c.request_id == request_id)
    ).one_or_none()


def counts(conn: Connection, prefix: str) -> tuple[int, int, int]:
    def count(table: Any, column: Any) -> int:
        return len(conn.execute(select(table).where(column.startswith(prefix))).all())

    return (
        count(samples, samples.c.request_id),
        count(feedback_events, feedback_events.c.request_id),
        len(
            conn.execute(
                select(rewards)
                .join(samples, samples.c.id == rewards.c.sample_id)
                .where(samples.c.request_id.startswith(prefix))
            ).all()
        ),
    )


def test_storing_the_same_events_twice_changes_nothing(conn: Connection, events: Any) -> None:
    batch = [events.completion(1), events.accepted(1), events.survival(1, 120, 0.75)]
    store(conn, *batch)
    first = reward_of(conn, events.request(1))
    store(conn, *batch)
    store(conn, batch[0].model_copy(update={"event_id": events.accepted(9).event_id}))

    assert counts(conn, events.prefix) == (1, 2, 1)
    again = reward_of(conn, events.request(1))
    assert again.components == first.components
    assert again.components["kept"] == 0.75
    assert again.components["accepted"] is True


def test_sample_content_is_stored_exactly(conn: Connection, events: Any) -> None:
    logprobs = [-0.1, -1 / 3, -1e-300, -123.456789012345678, 0.0, float("-inf"), float("nan")]
    completion = events.completion(
        1,
        completion_token_ids=[0, 1, 2**31 - 1, 7, 8, 9, 10],
        behaviour_logprobs=logprobs,
        prompt_messages=[{"role": "user", "content": 'a "quoted" {brace}, 不对\n'}],
        tools_declared=True,
        turn_index=2,
    )
    store(conn, completion)

    sample = conn.execute(select(samples).where(samples.c.request_id == events.request(1))).one()
    assert sample.completion_token_ids == completion.completion_token_ids
    assert sample.behaviour_logprobs[:-1] == logprobs[:-1]
    assert math.isnan(sample.behaviour_logprobs[-1])
    assert sample.prompt_messages == completion.prompt_messages
    assert sample.prompt_token_ids == [1, 2, 3]
    assert sample.trainable is True
    assert (sample.tools_declared, sample.turn_index, sample.edit_requested) == (True, 2, True)


def test_feedback_before_its_completion_is_joined_when_it_arrives(
    conn: Connection, events: Any
) -> None:
    early = [
        events.accepted(1),
        events.survival(1, 120, 0.5),
        events.followup(1, "still broken, same error"),
    ]
    store(conn, *early)
    assert counts(conn, events.prefix) == (0, 3, 0)

    completion = events.completion(1, latency_ms=5000.0)
    store(conn, completion)

    reward = reward_of(conn, events.request(1))
    expected = distil_components(
        completion, early, horizon_s=CONFIG.horizon_s, latency_budget_ms=CONFIG.latency_budget_ms
    )
    assert reward.components == expected.model_dump(mode="json")
    assert reward.components["dissatisfied"] is True
    assert reward.components["latency_over_budget"] is True
    assert reward.finalized_at is None
    assert reward.reward is None
    assert reward.due_at == early[0].occurred_at + CONFIG.survival_horizon + (
        CONFIG.finalization_grace
    )


def test_privacy_samples_keep_metrics_only(conn: Connection, events: Any) -> None:
    before = events.followup(1, "that broke it, revert that", after_s=20)
    store(conn, before)
    store(conn, events.completion(1, privacy=True), events.completion(2))
    after = events.followup(1, "still broken", after_s=40)
    public = events.followup(2, "thanks, looks good")
    store(conn, after, public)

    sample = conn.execute(select(samples).where(samples.c.request_id == events.request(1))).one()
    assert sample.privacy is True
    assert sample.trainable is False
    assert sample.completion_token_ids is None
    assert sample.completion_text is None
    assert sample.latency_ms == 400.0
    messages = dict(
        conn.execute(
            select(feedback_events.c.event_id, feedback_events.c.message).where(
                feedback_events.c.request_id.startswith(events.prefix)
            )
        ).all()
    )
    assert messages == {
        before.event_id: None,
        after.event_id: None,
        public.event_id: public.message,
    }
    verdicts = conn.execute(
        select(feedback_events.c.dissatisfied).where(
            feedback_events.c.request_id == events.request(1)
        )
    ).scalars()
    assert list(verdicts) == [True, True]
    assert reward_of(conn, events.request(1)).components["dissatisfied"] is True
    public_sample = conn.execute(
        select(samples).where(samples.c.request_id == events.request(2))
    ).one()
    assert public_sample.trainable is True
    assert public_sample.completion_token_ids == [4, 5]


def test_a_side_request_is_stored_marked_and_never_trainable(conn: Connection, events: Any) -> None:
    store(conn, events.completion(1, side_request="title"), events.completion(2))
    stored = {
        row.request_id: (row.side_request, row.trainable)
        for row in conn.execute(
            select(samples).where(samples.c.request_id.startswith(events.prefix))
        )
    }
    assert stored == {events.request(1): ("title", False), events.request(2): (None, True)}


def test_session_end_finalizes_only_what_can_learn_nothing_more(
    conn: Connection, events: Any
) -> None:
    store(
        conn,
        events.completion(1, session=0),
        events.completion(2, session=0, proposed_edit=False),
        events.accepted(1, session=0),
        events.survival(1, 120, 1.0, session=0),
    )
    store(conn, events.session_end(2, session=0))

    first, second = reward_of(conn, events.request(1)), reward_of(conn, events.request(2))
    assert second.finalize_reason == "session_end"
    assert second.components["kept"] == 0.0  # an edit was asked for and none proposed
    assert second.reward == compute_reward(
        distil_components(
            events.completion(2, session=0, proposed_edit=False),
            [],
            horizon_s=CONFIG.horizon_s,
            latency_budget_ms=CONFIG.latency_budget_ms,
        ),
        CONFIG.reward_version,
    )
    # The accepted edit still waits for its horizon report, which settles it when it comes.
    assert first.finalized_at is None
    store(conn, events.followup(1, "wrong again", after_s=300, session=0))
    store(conn, events.survival(1, CONFIG.horizon_s, 1.0, session=0))
    first = reward_of(conn, events.request(1))
    assert first.finalize_reason == "horizon"
    assert first.components["dissatisfied"] is True
    assert first.reward == 0.5


def test_a_question_is_distilled_as_a_question_from_the_stored_sample(
    conn: Connection, events: Any
) -> None:
    # Rewards are distilled from the stored sample, not the event: what the sample row keeps
    # is all a formula can see. Formula 0 (flawed on purpose) pays a question 0.5 whatever
    # the developer said next; the others judge it like any answer that proposed no edit.
    flawed = dataclasses.replace(CONFIG, reward_version=0)
    for n, config, expected in ((1, flawed, 0.5), (2, CONFIG, -0.5)):
        question = events.completion(n, proposed_edit=False, clarifying_question=True)
        store_events(
            conn,
            [sample_row(question)],
            [feedback_row(e) for e in (events.followup(n, "that's wrong"), events.session_end(n))],
            config,
            now=datetime.now(UTC),
        )
        reward = reward_of(conn, events.request(n))
        assert reward.finalized_at is not None and reward.reward_version == config.reward_version
        assert reward.components["clarifying_question"] is True
        assert reward.reward == expected


def test_late_evidence_reopens_a_final_reward_within_the_window_and_is_counted_after(
    conn: Connection, events: Any
) -> None:
    store(conn, events.completion(1), events.rejected(1), events.session_end(1))
    store(conn, events.completion(2), events.rejected(2), events.session_end(2))
    assert reward_of(conn, events.request(1)).reward == 0.0

    late = events.followup(1, "that is wrong, revert that", after_s=30)
    store(conn, late)
    store(conn, late)  # a redelivery is not new evidence
    reopened = reward_of(conn, events.request(1))
    assert reopened.finalize_reason == "session_end"
    assert reopened.components["dissatisfied"] is True
    assert reopened.reward == -0.5
    assert (reopened.reopen_count, reopened.late_evidence_count) == (1, 0)

    closed = dataclasses.replace(CONFIG, reopen_window=timedelta(0))
    store_events(
        conn,
        [],
        [feedback_row(events.followup(2, "revert that", after_s=30))],
        closed,
        now=datetime.now(UTC),
    )
    standing = reward_of(conn, events.request(2))
    assert standing.components["dissatisfied"] is None
    assert standing.reward == 0.0
    assert (standing.reopen_count, standing.late_evidence_count) == (0, 1)
    stored = conn.execute(
        select(feedback_events.c.kind).where(feedback_events.c.request_id == events.request(2))
    ).scalars()
    assert "followup_message" in list(stored)  # counted and kept, not lost


def test_a_survival_report_at_the_horizon_finalizes(conn: Connection, events: Any) -> None:
    store(conn, events.completion(1), events.accepted(1), events.survival(1, 120, 0.9))
    assert reward_of(conn, events.request(1)).finalized_at is None

    store(conn, events.survival(1, CONFIG.horizon_s, 0.6))

    reward = reward_of(conn, events.request(1))
    assert reward.finalize_reason == "horizon"
    assert reward.components["kept"] == 0.6
    assert reward.reward == 0.6
    assert reward.reward_version == CONFIG.reward_version


def test_rows_postgres_would_reject_are_named(events: Any) -> None:
    assert unstorable(samples, sample_row(events.completion(1))) is None
    too_long = sample_row(events.completion(1, checkpoint="c" * 65))
    assert unstorable(samples, too_long) == "checkpoint is longer than 64 characters"
    nul = sample_row(events.completion(1, finish_reason="stop\x00"))
    assert unstorable(samples, nul) == "finish_reason contains a NUL character"
    huge = sample_row(events.completion(1, completion_token_ids=[2**31], behaviour_logprobs=[-1.0]))
    assert (
        unstorable(samples, huge) == "completion_token_ids holds a value out of the integer range"
    )
    slow = sample_row(events.completion(1, latency_ms=float("inf")))
    assert unstorable(samples, slow) == "latency_ms is not a finite number"
    # A model's answer or a developer's prompt may hold NUL: stored as U+FFFD, never refused.
    scrubbed = sample_row(
        events.completion(1, prompt_messages=[{"content": "a\x00"}], completion_text="b\x00")
    )
    assert unstorable(samples, scrubbed) is None
    assert scrubbed["prompt_messages"] == [{"content": "a\ufffd"}]
    assert scrubbed["completion_text"] == "b\ufffd"


def test_a_kept_edit_on_the_third_turn_credits_the_runs_earlier_turns(
    conn: Connection, events: Any
) -> None:
    run = {"trajectory_id": events.request(1), "session": 0}
    turns = [
        events.completion(1, proposed_edit=False, turn_index=0, **run),
        events.completion(2, proposed_edit=False, turn_index=1, **run),
        events.completion(3, turn_index=2, **run),
    ]
    store(conn, *turns)
    store(conn, events.session_end(1, session=0))
    # The session ended before the edit's fate was reported: the edit is censored, and the
    # turns that led to it share its prior (0.5 under formula 6), not a rejected edit's blame.
    assert reward_weights(CONFIG.reward_version).censored_kept == 0.5
    censored = [reward_of(conn, events.request(n)) for n in (1, 2, 3)]
    assert censored[2].components["kept"] is None
    assert [r.reward for r in censored] == pytest.approx([0.405, 0.45, 0.5])

    store(
        conn,
        events.accepted(3, session=0),
        events.survival(3, CONFIG.horizon_s, 1.0, session=0),
    )

    credited = [reward_of(conn, events.request(n)).reward for n in (1, 2, 3)]
    assert credited == pytest.approx([0.81, 0.9, 1.0])


def test_an_erased_users_events_still_in_kafka_are_not_stored_again(
    conn: Connection, events: Any
) -> None:
    served = [events.completion(1), events.accepted(1), events.survival(1, 120, 0.75)]
    early = events.accepted(2)  # arrives before its completion, which Kafka still holds
    store(conn, *served, early)
    user = served[0].user_hash
    erase_in_database(conn, user, user_history(conn, user), now=datetime.now(UTC))
    # Feedback names no user: the early event waits for its completion to be recognised.
    assert counts(conn, events.prefix) == (0, 1, 0)

    store(conn, *served)  # redelivered after a rebalance
    store(conn, events.followup(1, "still broken"))  # later feedback on the erased session
    store(conn, events.completion(2))  # served before the erasure, delivered after it
    store(conn, events.session_end(2))
    assert counts(conn, events.prefix) == (0, 0, 0)

    # What the gateway serves the user after the erasure is stored as usual.
    after = events.completion(3, occurred_at=datetime.now(UTC) + timedelta(seconds=1))
    store(conn, after, events.accepted(3))
    assert counts(conn, events.prefix) == (1, 1, 1)
