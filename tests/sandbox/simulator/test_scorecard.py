"""The agent scorecard over users: rates with intervals, never NaN."""

from __future__ import annotations

import math

from sandbox.simulator.report import AgentRun
from sandbox.simulator.scorecard import scorecards


def run(user: str, checkpoint: str, *, accepted: bool, calls: int, malformed: int) -> AgentRun:
    return AgentRun(
        user_id=user,
        checkpoint=checkpoint,
        task_id="t",
        turns=3,
        edited=accepted,
        solved=accepted,
        accepted=accepted,
        tool_calls=calls,
        malformed_calls=malformed,
        clarifying_question=False,
        read_before_edit=True,
        abandoned=False,
    )


def test_a_rate_every_user_shares_has_a_zero_width_interval_not_nan() -> None:
    # Every user's calls are a third malformed: a zero variance that the moments'
    # cancellation rounds to about -2e-18 with these ten users.
    runs = [
        run(f"u{i}", "base", accepted=i % 3 == 0, calls=3 * (1 + i % 3), malformed=1 + i % 3)
        for i in range(10)
    ]
    (card,) = scorecards(runs, reference="base")

    malformed = card.metrics["malformed_call_rate"]
    assert malformed.value == malformed.ci_low == malformed.ci_high
    assert malformed.value is not None and math.isclose(malformed.value, 1 / 3)
    kept = card.metrics["kept_edit_rate"]
    assert kept.value is not None and kept.ci_low is not None and kept.ci_high is not None
    assert kept.ci_low < kept.value < kept.ci_high
