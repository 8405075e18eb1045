"""bench.agent_runs' comparison of two checkpoints' shares (the runs themselves are
trainer.agent_runs', tested in tests/trainer/test_agent_gate.py)."""

from __future__ import annotations

import pytest

from bench.agent_runs import Result, difference


def test_the_difference_of_two_shares_has_a_95_percent_interval_around_it() -> None:
    gap, low, high = difference((0.6, 600), (0.5, 600))
    standard_error = (0.6 * 0.4 / 600 + 0.5 * 0.5 / 600) ** 0.5
    assert gap == pytest.approx(0.1)
    assert (low, high) == pytest.approx(
        (0.1 - 1.96 * standard_error, 0.1 + 1.96 * standard_error), abs=1e-4
    )
    assert Result("empty").solved == (0.0, 0)
