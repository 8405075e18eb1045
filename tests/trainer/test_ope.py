"""Off-policy estimates on synthetic logs whose true answer is known."""

from __future__ import annotations

import math

import numpy as np
import pytest

from trainer.ope import (
    normalized_weights,
    pareto_k,
    predict_ratio,
    sequence_log_weights,
    weight_diagnostics,
)


def logged_bandit(
    rng: np.random.Generator, n: int, p_behaviour: float, p_candidate: float, users: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """One-token answers: production says "yes" with p_behaviour and is rewarded 1 for it.
    Returns rewards, log weights of the candidate, and each sample's user."""
    yes = rng.random(n) < p_behaviour
    reward = yes.astype(float)
    log_w = np.where(
        yes,
        math.log(p_candidate) - math.log(p_behaviour),
        math.log(1 - p_candidate) - math.log(1 - p_behaviour),
    )
    who = [f"u{k}" for k in rng.integers(0, users, n)]
    return reward, log_w, who


def test_the_candidate_equal_to_production_predicts_no_difference() -> None:
    rng = np.random.default_rng(1)
    reward, _, who = logged_bandit(rng, 2000, 0.5, 0.5, users=200)
    logprobs = [[-0.7, -1.2], [-0.1]] * 1000
    log_w = sequence_log_weights(logprobs, logprobs)
    assert np.all(log_w == 0)
    prediction = predict_ratio(reward, np.ones_like(reward), normalized_weights(log_w), who)
    assert prediction is not None
    assert prediction.difference == 0.0
    assert prediction.ci_low is not None and prediction.ci_high is not None
    assert prediction.ci_low <= 0.0 <= prediction.ci_high
    assert prediction.diagnostics.reliable
    assert prediction.diagnostics.effective_fraction == 1.0


def test_intervals_cover_the_true_difference_about_as_often_as_they_claim() -> None:
    rng = np.random.default_rng(2)
    covered, signs, runs = 0, 0, 200
    for run in range(runs):
        reward, log_w, who = logged_bandit(rng, 1500, 0.5, 0.6, users=150)
        prediction = predict_ratio(
            reward, np.ones_like(reward), normalized_weights(log_w), who, resamples=400, seed=run
        )
        assert prediction is not None and prediction.ci_low is not None
        assert prediction.ci_high is not None
        covered += prediction.ci_low <= 0.1 <= prediction.ci_high
        signs += prediction.difference > 0
    assert 0.88 <= covered / runs <= 0.99  # 95% nominal; 200 runs put the rate within ±3 pp
    assert signs == runs


def test_a_worse_candidate_is_predicted_worse_and_clipping_shrinks_toward_zero() -> None:
    rng = np.random.default_rng(3)
    reward, log_w, who = logged_bandit(rng, 3000, 0.5, 0.2, users=300)
    prediction = predict_ratio(reward, np.ones_like(reward), normalized_weights(log_w), who)
    assert prediction is not None and prediction.ci_high is not None
    assert prediction.ci_high < 0
    assert abs(prediction.difference + 0.3) < 0.05
    assert prediction.clipped_difference >= prediction.difference - 1e-12


def test_a_ratio_metric_counts_only_samples_that_have_its_denominator() -> None:
    # Malformed calls per answer with a tool call: answers without one do not count.
    malformed = np.array([1.0, 0.0, 0.0, 0.0])
    with_call = np.array([1.0, 1.0, 0.0, 0.0])
    weights = np.array([3.0, 1.0, 5.0, 5.0])
    prediction = predict_ratio(malformed, with_call, weights, ["a", "b", "c", "d"], resamples=50)
    assert prediction is not None
    assert (prediction.production, prediction.candidate) == (0.5, 0.75)
    assert prediction.observations == 2
    assert predict_ratio(malformed, np.zeros(4), weights, ["a"] * 4) is None


def test_long_divergent_answers_are_flagged_unreliable() -> None:
    rng = np.random.default_rng(4)
    # 200-token answers, per-token log-ratios with sd 0.3: weights span many orders.
    log_w = rng.normal(0, 0.3, size=(1000, 200)).sum(axis=1)
    diagnostics = weight_diagnostics(normalized_weights(log_w))
    assert not diagnostics.reliable
    assert diagnostics.effective_fraction < 0.05
    k = pareto_k(normalized_weights(log_w))
    assert k is not None and k > 0.7
    # Short answers of a conservative update are fine.
    short = rng.normal(0, 0.05, size=(1000, 8)).sum(axis=1)
    assert weight_diagnostics(normalized_weights(short)).reliable


def test_a_heavy_tail_of_rounding_noise_is_not_a_reason_to_distrust_the_estimate() -> None:
    rng = np.random.default_rng(5)
    # Log-ratios with a heavy-tailed shape (Student's t, 1 degree of freedom)...
    shape = rng.standard_t(1, size=250)
    # ...at the size fp32 rescoring leaves: every weight within a fraction of a percent of 1.
    noise = normalized_weights(1e-4 * shape)
    k = pareto_k(noise)
    assert k is not None and k > 0.7  # k̂ reads the shape whatever its scale
    assert weight_diagnostics(noise).reliable
    # The same shape at a scale that moves estimates is a heavy tail.
    assert not weight_diagnostics(normalized_weights(shape)).reliable


def test_the_estimate_and_its_tail_diagnostic_agree_with_maintained_libraries() -> None:
    """Oracles on synthetic logs: Vowpal Wabbit's SNIPS estimator for the estimate, arviz-stats'
    PSIS for k̂ (the same numbers, so the thresholds mean what the literature means)."""
    from arviz_stats.base import array_stats
    from estimators.bandits import snips

    rng = np.random.default_rng(5)
    reward, log_w, who = logged_bandit(rng, 3000, 0.4, 0.55, users=300)
    p_behaviour = np.where(reward == 1, 0.4, 0.6)
    oracle = snips.Estimator()
    for r, p, lw in zip(reward, p_behaviour, log_w, strict=True):
        oracle.add_example(p_log=float(p), r=float(r), p_pred=float(p * math.exp(lw)))
    prediction = predict_ratio(reward, np.ones_like(reward), normalized_weights(log_w), who)
    assert prediction is not None
    assert prediction.candidate == pytest.approx(oracle.get(), abs=1e-12)
    assert prediction.candidate == pytest.approx(0.55, abs=0.05)

    for scale in (0.3, 1.5, 3.0):
        heavy = rng.normal(0, scale, 800)
        _, k = array_stats.psislw(heavy.copy())
        assert pareto_k(normalized_weights(heavy)) == pytest.approx(float(k), abs=1e-9)
