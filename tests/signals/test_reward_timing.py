"""Reward timing from client-set times: each event is read at a time it can have happened."""

from datetime import UTC, datetime, timedelta
from typing import Any

from app.events import CompletionEvent, EditAccepted, EditSurvival
from app.signals.rewards import (
    FEEDBACK_CLOCK_SKEW_S,
    MAX_ACCEPT_DELAY_S,
    Feedback,
    distil_components,
    evidence_for,
    finalize_reason,
    reward_due_at,
)

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
HORIZON_S = 900.0
GRACE_S = 120.0
FAR_FUTURE = datetime(2100, 1, 1, tzinfo=UTC)
BOUND = T0 + timedelta(seconds=MAX_ACCEPT_DELAY_S + HORIZON_S + GRACE_S)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def completion() -> CompletionEvent:
    return CompletionEvent(
        session_id="s1",
        request_id="r1",
        occurred_at=T0,
        checkpoint="ckpt-1",
        user_hash="u1",
        edit_requested=True,
        proposed_edit=True,
        ttft_ms=100.0,
        latency_ms=800.0,
    )


def accepted(occurred_at: datetime, received_at: datetime | None) -> EditAccepted:
    return EditAccepted(
        session_id="s1", request_id="r1", occurred_at=occurred_at, received_at=received_at
    )


def survival(
    elapsed_s: float, share: float, occurred_at: datetime, received_at: datetime | None
) -> EditSurvival:
    return EditSurvival(
        session_id="s1",
        request_id="r1",
        occurred_at=occurred_at,
        received_at=received_at,
        elapsed_s=elapsed_s,
        surviving_share=share,
    )


def due(feedback: list[Feedback]) -> datetime:
    return reward_due_at(completion(), feedback, horizon_s=HORIZON_S, grace_s=GRACE_S)


def reason(feedback: list[Feedback], now: datetime) -> str | None:
    return finalize_reason(completion(), feedback, horizon_s=HORIZON_S, grace_s=GRACE_S, now=now)


def distil(feedback: list[Feedback]) -> Any:
    return distil_components(completion(), feedback, horizon_s=HORIZON_S, latency_budget_ms=2000)


def test_an_acceptance_dated_in_the_far_future_counts_from_its_receipt() -> None:
    feedback: list[Feedback] = [accepted(FAR_FUTURE, received_at=at(5))]
    assert due(feedback) == at(5 + FEEDBACK_CLOCK_SKEW_S + HORIZON_S + GRACE_S)
    assert reason(feedback, now=due(feedback)) == "timeout"


def test_an_acceptance_from_before_receipts_were_stamped_is_held_to_the_bound() -> None:
    """An event queued before gateways stamped receipts: however late it says the acceptance
    came, the reward is due at its bound and finalized there as censored."""
    feedback: list[Feedback] = [accepted(FAR_FUTURE, received_at=None)]
    assert due(feedback) == BOUND
    assert reason(feedback, now=BOUND - timedelta(seconds=1)) is None
    assert reason(feedback, now=BOUND) == "censored"


def test_an_acceptance_dated_before_its_completion_counts_from_the_completion() -> None:
    feedback: list[Feedback] = [accepted(T0 - timedelta(days=400), received_at=at(5))]
    assert due(feedback) == at(HORIZON_S + GRACE_S)
    assert [signal.occurred_at for signal in evidence_for(completion(), feedback)] == [T0]


def test_a_horizon_report_one_second_after_the_acceptance_is_left_out_and_counted() -> None:
    instant = survival(900, 1.0, occurred_at=at(910), received_at=at(11))
    feedback: list[Feedback] = [accepted(at(10), received_at=at(10)), instant]
    # Not final: the report's 900 s had not passed when it was received.
    assert reason(feedback, now=at(11)) is None
    components = distil(feedback)
    assert components.survival_elapsed_s == 0.0  # the acceptance's own window
    assert components.survival_reports_ignored == 1


def test_a_backdated_acceptance_does_not_make_an_instant_report_plausible() -> None:
    feedback: list[Feedback] = [
        accepted(T0 - timedelta(days=1), received_at=at(1)),
        survival(900, 1.0, occurred_at=at(2), received_at=at(2)),
    ]
    assert reason(feedback, now=at(2)) is None
    assert distil(feedback).survival_reports_ignored == 1


def test_reports_sent_together_long_after_they_were_measured_are_taken() -> None:
    """An IDE that was offline sends its acceptance and its horizon report in one batch,
    twenty minutes on: both happened before they were received."""
    sent = at(1200)
    feedback: list[Feedback] = [
        accepted(at(10), received_at=sent),
        survival(900, 0.75, occurred_at=at(910), received_at=sent),
    ]
    assert reason(feedback, now=sent) == "horizon"
    components = distil(feedback)
    assert (components.kept, components.survival_elapsed_s) == (0.75, 900)
    assert components.survival_reports_ignored == 0


def test_a_client_clock_ahead_by_less_than_the_skew_loses_nothing() -> None:
    ahead = timedelta(seconds=FEEDBACK_CLOCK_SKEW_S - 5)
    feedback: list[Feedback] = [
        accepted(at(10) + ahead, received_at=at(10)),
        survival(900, 0.5, occurred_at=at(910) + ahead, received_at=at(910)),
    ]
    assert reason(feedback, now=at(910)) == "horizon"
    assert distil(feedback).kept == 0.5
