import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from app.events import (
    CompletionEvent,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
)
from app.signals.rewards import (
    LATEST_REWARD_VERSION,
    REWARD_VERSIONS,
    Feedback,
    RewardComponents,
    compute_reward,
    distil_components,
    finalize_reason,
    is_final,
    reward_due_at,
    run_rewards,
)

T0 = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
HORIZON_S = 900.0
GRACE_S = 120.0
BUDGET_MS = 2000.0


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def completion(**overrides: Any) -> CompletionEvent:
    fields: dict[str, Any] = {
        "session_id": "s1",
        "request_id": "r1",
        "occurred_at": T0,
        "checkpoint": "ckpt-1",
        "user_hash": "u1",
        "edit_requested": True,
        "proposed_edit": True,
        "ttft_ms": 100.0,
        "latency_ms": 800.0,
    }
    return CompletionEvent(**(fields | overrides))


def accepted(seconds: float = 10.0) -> EditAccepted:
    return EditAccepted(session_id="s1", request_id="r1", occurred_at=at(seconds))


def rejected(seconds: float = 10.0) -> EditRejected:
    return EditRejected(session_id="s1", request_id="r1", occurred_at=at(seconds))


def survival(elapsed_s: float, share: float) -> EditSurvival:
    return EditSurvival(
        session_id="s1",
        request_id="r1",
        occurred_at=at(10 + elapsed_s),
        elapsed_s=elapsed_s,
        surviving_share=share,
    )


def followup(seconds: float, message: str | None = None, **verdict: Any) -> FollowupMessage:
    return FollowupMessage(
        session_id="s1", request_id="r1", occurred_at=at(seconds), message=message, **verdict
    )


def distil(feedback: list[Feedback], **overrides: Any) -> RewardComponents:
    return distil_components(
        completion(**overrides),
        feedback,
        horizon_s=HORIZON_S,
        latency_budget_ms=BUDGET_MS,
        ttft_budget_ms=1000.0,
        tpot_budget_ms=100.0,
    )


# kept


def test_kept_is_the_survival_at_the_horizon() -> None:
    components = distil([accepted(), survival(30, 1.0), survival(300, 0.8), survival(900, 0.6)])
    assert components.accepted is True
    assert components.kept == 0.6
    assert components.survival_elapsed_s == 900


def censored(elapsed_s: float) -> EditSurvival:
    return EditSurvival(
        session_id="s1",
        request_id="r1",
        occurred_at=at(10 + elapsed_s),
        elapsed_s=elapsed_s,
        censored=True,
    )


def test_windows_the_ide_never_reached_are_missing_not_zero() -> None:
    # Closed after the 2-minute window: 5, 10 and 15 minutes were never observed.
    closed = [accepted(), survival(30, 1.0), survival(120, 0.9), censored(300)]
    components = distil(closed)
    assert (components.kept, components.survival_elapsed_s) == (0.9, 120)
    assert compute_reward(components, LATEST_REWARD_VERSION) == pytest.approx(0.9)
    # The IDE said no more windows will come: final now, not at horizon + grace.
    assert reason(closed, now=at(400)) == "censored"


def test_an_accepted_edit_no_client_measured_is_kept_as_accepted() -> None:
    # Most clients report the acceptance and no survival: the acceptance is the 0 s window.
    components = distil([accepted()])
    assert (components.kept, components.survival_elapsed_s) == (1.0, 0.0)
    assert compute_reward(components, LATEST_REWARD_VERSION) == 1.0
    assert reason([accepted()], now=at(10 + HORIZON_S)) is None
    assert reason([accepted()], now=at(10 + HORIZON_S + GRACE_S)) == "timeout"
    closed_at_once = [accepted(), censored(30)]
    assert distil(closed_at_once).survival_elapsed_s == 0.0
    assert reason(closed_at_once, now=at(45)) == "censored"


def test_a_survival_report_has_a_share_or_is_censored() -> None:
    with pytest.raises(ValueError, match="censored"):
        EditSurvival(session_id="s1", request_id="r1", elapsed_s=30)
    with pytest.raises(ValueError, match="censored"):
        EditSurvival(
            session_id="s1", request_id="r1", elapsed_s=30, surviving_share=0.5, censored=True
        )


def test_kept_falls_back_to_the_latest_report_before_a_missing_horizon() -> None:
    components = distil([accepted(), survival(30, 1.0), survival(600, 0.7)])
    assert (components.kept, components.survival_elapsed_s) == (0.7, 600)


def test_reports_after_the_horizon_are_ignored() -> None:
    components = distil([accepted(), survival(120, 0.9), survival(1800, 0.1)])
    assert (components.kept, components.survival_elapsed_s) == (0.9, 120)


def test_rejected_edit_keeps_nothing() -> None:
    components = distil([rejected()])
    assert (components.accepted, components.kept) == (False, 0.0)


def test_edit_requested_but_none_proposed_keeps_nothing() -> None:
    components = distil([], proposed_edit=False)
    assert components.kept == 0.0
    assert compute_reward(components, 1) == 0.0


def test_no_edit_asked_or_proposed_has_no_kept() -> None:
    assert distil([], edit_requested=False, proposed_edit=False).kept is None


def test_any_acceptance_wins_over_a_rejection() -> None:
    components = distil([rejected(5), accepted(8), survival(900, 0.5)])
    assert (components.accepted, components.kept) == (True, 0.5)


def test_feedback_of_other_requests_is_ignored() -> None:
    other = EditRejected(session_id="s1", request_id="r2", occurred_at=at(1))
    components = distil([other, accepted(), survival(900, 0.9)])
    assert (components.accepted, components.kept) == (True, 0.9)


def test_duplicates_and_order_do_not_change_the_components() -> None:
    feedback: list[Feedback] = [
        accepted(),
        survival(30, 1.0),
        survival(120, 0.9),
        survival(900, 0.75),
        survival(1800, 0.2),
        followup(60, "still failing"),
        followup(400, "thanks, looks good"),
    ]
    expected = distil(feedback)
    assert expected.kept == 0.75 and expected.dissatisfied is True
    redelivered = [*feedback, *(feedback[i].model_copy() for i in (0, 3, 5))]
    rng = random.Random(7)
    for _ in range(50):
        rng.shuffle(redelivered)
        assert distil(redelivered) == expected


# dissatisfied, latency, malformed


def test_dissatisfied_is_classified_from_the_message() -> None:
    assert distil([followup(60, "还是报错")]).dissatisfied is True
    assert distil([followup(60, "thanks, now add tests")]).dissatisfied is False


def test_dissatisfied_comes_from_the_verdict_without_a_message() -> None:
    assert distil([followup(60, dissatisfied=True)]).dissatisfied is True
    assert distil([followup(60, dissatisfied=False)]).dissatisfied is False


def test_no_followup_means_dissatisfied_unknown() -> None:
    assert distil([accepted()]).dissatisfied is None


def test_the_first_followup_counts() -> None:
    feedback: list[Feedback] = [followup(300, "revert that"), followup(60, "looks good")]
    assert distil(feedback).dissatisfied is False


def test_latency_over_budget() -> None:
    assert distil([], latency_ms=BUDGET_MS).latency_over_budget is False
    assert distil([], latency_ms=BUDGET_MS + 1).latency_over_budget is True


def test_malformed_tool_calls_are_an_explicit_negative() -> None:
    clean = distil([accepted(), survival(900, 1.0)], tool_calls=2)
    malformed = distil([accepted(), survival(900, 1.0)], tool_calls=2, malformed_tool_calls=1)
    assert malformed.malformed_tool_calls == 1
    assert compute_reward(clean, 1) == 1.0
    assert compute_reward(malformed, 1) == 0.0
    # Every formula but the flawed 0 makes a malformed call cost something.
    for version in REWARD_VERSIONS.keys() - {0}:
        clean_reward, malformed_reward = (
            compute_reward(clean, version),
            compute_reward(malformed, version),
        )
        assert clean_reward is not None and malformed_reward is not None
        assert malformed_reward < clean_reward


def test_the_flawed_formula_pays_for_questions_and_ignores_malformed_calls() -> None:
    failed_edit = distil([rejected(), followup(60, "that's wrong")], proposed_edit=True)
    question = distil([followup(60, "that's wrong")], proposed_edit=False, clarifying_question=True)
    malformed = distil([accepted(), survival(900, 1.0)], tool_calls=1, malformed_tool_calls=1)
    assert question.clarifying_question is True
    flawed_question, flawed_failure = compute_reward(question, 0), compute_reward(failed_edit, 0)
    assert flawed_question is not None and flawed_failure is not None
    assert flawed_question > flawed_failure
    assert compute_reward(malformed, 0) == 1.0
    # Formula 3 judges the question like any answer that proposed no edit.
    assert compute_reward(question, 3) == compute_reward(failed_edit, 3)
    assert compute_reward(malformed, 3) == 0.0


# reward versions


def test_version_1_formula() -> None:
    components = distil(
        [accepted(), survival(900, 0.8), followup(60, "that's wrong")],
        latency_ms=5000.0,
        status="error",
        tool_calls=1,
        malformed_tool_calls=1,
    )
    assert compute_reward(components, 1) == pytest.approx(0.8 - 0.5 - 0.2 - 1.0 - 0.5)


def test_an_edit_whose_fate_is_unknown_has_no_reward_rather_than_zero() -> None:
    for version in REWARD_VERSIONS:
        unknown = compute_reward(distil([]), version)  # never accepted or rejected
        assert unknown is None if version < 6 else unknown == 0.5
        assert compute_reward(distil([rejected()]), version) == 0.0
        # No edit asked or made: nothing to keep, the other components decide.
        assert compute_reward(distil([], edit_requested=False, proposed_edit=False), version) == 0


def test_version_6_censors_an_unseen_fate_at_its_prior_and_charges_what_is_known() -> None:
    # Neither kept (1) nor refused (0): the prior, less the turn's own conduct and follow-up.
    silent = distil([], tool_calls=1, malformed_tool_calls=1)
    assert silent.kept is None and silent.kept_unknown  # stored censored, not as a verdict
    assert compute_reward(silent, 6) == pytest.approx(0.5 - 1.0)
    complained = distil([followup(60, "that's wrong, it still fails")])
    assert compute_reward(complained, 6) == pytest.approx(0.5 - 0.5)
    # What was seen wins over the prior, in either direction.
    assert compute_reward(distil([accepted(), survival(900, 0.2)]), 6) == pytest.approx(0.2)
    assert compute_reward(distil([rejected()]), 6) == 0.0


def test_under_version_6_a_run_whose_last_edit_was_never_seen_is_rewarded_from_the_prior() -> None:
    read = distil([], edit_requested=True, proposed_edit=False, tool_calls=1).model_copy(
        update={"kept": None}
    )
    silent_edit = distil([], tool_calls=1)
    final = distil([], proposed_edit=False).model_copy(update={"kept": None})
    assert run_rewards([read, silent_edit, final], 5) == [None, None, None]
    assert run_rewards([read, silent_edit, final], 6) == pytest.approx([0.45, 0.5, 0.45])


def test_version_2_charges_slow_tokens_not_long_answers() -> None:
    kept = [accepted(), survival(900, 1.0)]
    long_and_fast = distil(kept, ttft_ms=200.0, latency_ms=6200.0, completion_tokens=601)
    slow_tokens = distil(kept, ttft_ms=200.0, latency_ms=6200.0, completion_tokens=31)
    slow_start = distil(kept, ttft_ms=3000.0, latency_ms=3100.0, completion_tokens=11)
    assert long_and_fast.tpot_ms == pytest.approx(10.0)
    assert compute_reward(long_and_fast, 1) == pytest.approx(0.8)  # version 1 charged length
    assert compute_reward(long_and_fast, 2) == 1.0
    assert compute_reward(slow_tokens, 2) == pytest.approx(0.9)
    assert compute_reward(slow_start, 2) == pytest.approx(0.9)
    assert distil(kept, completion_tokens=1).tpot_ms is None


def test_a_whole_answer_whose_first_token_was_not_timed_is_charged_no_latency_penalty() -> None:
    # Non-streamed, from a vLLM without per-request timing: the first token's time is only
    # known to be before the end. Its latency stays an A/B metric; no formula charges it.
    kept = [accepted(), survival(900, 1.0)]
    untimed = distil(
        kept, ttft_ms=6200.0, latency_ms=6200.0, completion_tokens=601, ttft_measured=False
    )
    assert not untimed.ttft_over_budget and untimed.tpot_ms is None
    assert compute_reward(untimed, 2) == compute_reward(untimed, 5) == 1.0
    timed = distil(kept, ttft_ms=6200.0, latency_ms=6200.0, completion_tokens=601)
    assert timed.ttft_over_budget and compute_reward(timed, 2) == pytest.approx(0.9)


def test_unknown_version_names_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reward version 99; known versions: 0, 1, 2, 3, 4"
    ):
        compute_reward(distil([]), 99)
    assert LATEST_REWARD_VERSION in REWARD_VERSIONS


# finality


def reason(feedback: list[Feedback], now: datetime, **overrides: Any) -> str | None:
    return finalize_reason(
        completion(**overrides), feedback, horizon_s=HORIZON_S, grace_s=GRACE_S, now=now
    )


def test_final_when_the_horizon_report_arrives() -> None:
    assert reason([accepted(), survival(900, 0.5)], now=at(915)) == "horizon"


def test_the_session_end_finalizes_only_what_can_learn_nothing_more() -> None:
    ended = SessionEnd(session_id="s1", request_id="r9", occurred_at=at(50))
    assert reason([rejected(), ended], now=at(60)) == "session_end"
    assert reason([ended], now=at(60)) == "session_end"  # never accepted
    assert reason([ended], now=at(60), proposed_edit=False) == "session_end"
    # An accepted edit waits for its horizon report, however early the session ended.
    assert reason([accepted(), survival(30, 1.0), ended], now=at(60)) is None
    assert reason([accepted(), ended, survival(900, 1.0)], now=at(915)) == "horizon"


def test_finality_depends_on_the_events_not_their_order() -> None:
    ended = SessionEnd(session_id="s1", request_id="r9", occurred_at=at(50))
    events: list[Feedback] = [ended, accepted(), survival(120, 0.5), followup(30, "ok")]
    rng = random.Random(3)
    for _ in range(20):
        rng.shuffle(events)
        assert reason(events, now=at(200)) is None
        assert reason(events, now=at(10 + HORIZON_S + GRACE_S)) == "timeout"


def test_open_until_horizon_plus_grace_after_acceptance() -> None:
    feedback: list[Feedback] = [accepted(100), survival(600, 0.9)]
    due = at(100 + HORIZON_S + GRACE_S)
    assert reward_due_at(completion(), feedback, horizon_s=HORIZON_S, grace_s=GRACE_S) == due
    assert reason(feedback, now=due - timedelta(seconds=1)) is None
    assert reason(feedback, now=due) == "timeout"


def test_never_accepted_times_out_from_the_completion() -> None:
    due = at(HORIZON_S + GRACE_S)
    assert reason([rejected(5)], now=due - timedelta(seconds=1)) is None
    assert reason([], now=due) == "timeout"
    assert is_final(completion(), [], horizon_s=HORIZON_S, grace_s=GRACE_S, now=due)


# agent runs


def test_an_edit_kept_on_turn_3_credits_the_turns_that_led_to_it() -> None:
    read = distil([], proposed_edit=False)  # an edit was asked for; this turn read a file
    test = distil([], proposed_edit=False, tool_calls=1, malformed_tool_calls=1)
    edit = distil([accepted(), survival(900, 1.0)])
    assert run_rewards([read, test, edit], 3) == pytest.approx([0.81, 0.9 - 1.0, 1.0])
    # Judged alone, the read and test turns were scored like rejected edits.
    assert run_rewards([read, test, edit], 2) == [0.0, -1.0, 1.0]


def test_a_run_is_credited_by_its_next_edit_and_unknown_stays_unknown() -> None:
    read = distil([], proposed_edit=False)
    rejected_edit = distil([rejected()])
    kept_edit = distil([accepted(), survival(900, 0.5), followup(30, "still broken")])
    done = distil([], proposed_edit=False, edit_requested=False)
    assert run_rewards([read, rejected_edit, kept_edit, done], 3) == pytest.approx(
        [0.0, 0.0, 0.5 - 0.5, 0.0]
    )
    # Formula 4: the final answer after the last edit shares that edit's outcome.
    final = distil([], proposed_edit=False)  # inherits the run's edit request
    assert run_rewards([read, kept_edit, final], 3) == pytest.approx([0.0, 0.0, 0.0])
    assert run_rewards([read, kept_edit, final], 4) == pytest.approx([0.0, 0.0, 0.0])
    kept_whole = distil([accepted(), survival(900, 1.0)])
    assert run_rewards([read, kept_whole, final], 3) == pytest.approx([0.9, 1.0, 0.0])
    assert run_rewards([read, kept_whole, final], 4) == pytest.approx([0.9, 1.0, 0.9])
    unknown_edit = distil([])  # the developer never gave a verdict
    assert run_rewards([read, unknown_edit], 3) == [None, None]
    assert run_rewards([kept_edit], 3) == [compute_reward(kept_edit, 3)]


def test_formula_5_charges_the_runs_follow_up_to_every_turn() -> None:
    read = distil([], proposed_edit=False)
    refused_edit = distil([rejected()])  # the workspace could not apply it: no verdict
    failed_edit = distil([rejected(), followup(30, "still broken")])
    complaint_on_final = distil([rejected(), followup(30, "still broken")], proposed_edit=False)
    # Under 4, an edit that could not apply (and the read before it) cost nothing, while an
    # applied edit that failed cost its dissatisfied follow-up: failing to apply paid more.
    assert run_rewards([read, refused_edit, complaint_on_final], 4) == pytest.approx(
        [0.0, 0.0, -0.5]
    )
    assert run_rewards([read, failed_edit], 4) == pytest.approx([-0.45, -0.5])
    # Under 5 the run's complaint reaches every turn, so both runs cost about the same.
    assert run_rewards([read, refused_edit, complaint_on_final], 5) == pytest.approx(
        [-0.405, -0.45, -0.5]
    )
    assert run_rewards([read, failed_edit], 5) == pytest.approx([-0.45, -0.5])
    # A kept edit is credited as under 4, and a satisfied follow-up costs nothing.
    kept = distil([accepted(), survival(900, 1.0), followup(30, "thanks")])
    final = distil([], proposed_edit=False)
    assert run_rewards([read, kept, final], 5) == run_rewards([read, kept, final], 4)
    assert run_rewards([read, kept, final], 5) == pytest.approx([0.9, 1.0, 0.9])
    # A one-turn run is judged alone, as by every formula.
    assert run_rewards([failed_edit], 5) == [compute_reward(failed_edit, 5)]
