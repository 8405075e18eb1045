"""Treatment-versus-control statistics from per-arm summaries, and the sample-ratio check.

Arms are aggregated in SQL (counts, sums, variances, percentiles), so each test here works
from summary statistics, with maintained libraries already among the dependencies:
- proportions: the Agresti–Caffo interval and test for a difference of two proportions
  (`statsmodels.stats.proportion.confint_proportions_2indep` / `test_proportions_2indep`,
  both `method="agresti-caffo"`). One statistic serves both, so the interval excludes 0
  exactly when p < 0.05, and it stays defined at 0% or 100% (rare malformed calls).
- means: Welch's unequal-variance t-test (`scipy.stats.ttest_ind_from_stats`, which takes
  means, standard deviations and counts; statsmodels' `CompareMeans` needs the raw rows),
  its interval from the same Welch–Satterthwaite degrees of freedom.
- percentiles: a normal approximation whose standard errors come from each arm's sparsity
  (difference-quotient density) estimate, Koenker, "Quantile Regression" (2005), §3.4.
- sample-ratio mismatch: Pearson's chi-square of users per arm against the arms' weights
  (`scipy.stats.chisquare`), flagged below p = 0.001 as is customary (Fabijan et al.,
  "Diagnosing Sample Ratio Mismatch in Online Controlled Experiments", KDD 2019).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats
from statsmodels.stats.proportion import confint_proportions_2indep, test_proportions_2indep

CONFIDENCE = 0.95
SRM_ALPHA = 0.001
_Z = float(stats.norm.ppf(0.5 + CONFIDENCE / 2))


@dataclass(frozen=True)
class Comparison:
    """Treatment minus control: the difference, its interval and two-sided p-value."""

    difference: float
    relative_difference: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None


@dataclass(frozen=True)
class SampleRatio:
    chi_square: float
    p_value: float
    mismatch: bool


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _relative(difference: float, control: float) -> float | None:
    return difference / control if control != 0 else None


def compare_proportions(
    successes_t: int, observations_t: int, successes_c: int, observations_c: int
) -> Comparison | None:
    """Difference of two proportions (Agresti–Caffo); None without observations."""
    if observations_t == 0 or observations_c == 0:
        return None
    args = (successes_t, observations_t, successes_c, observations_c)
    # statsmodels also computes ratios and odds ratios, which divide by zero at 0% or 100%.
    with np.errstate(divide="ignore", invalid="ignore"):
        low, high = confint_proportions_2indep(
            *args, method="agresti-caffo", compare="diff", alpha=1 - CONFIDENCE
        )
        test = test_proportions_2indep(*args, method="agresti-caffo", compare="diff")
    rate_c = successes_c / observations_c
    difference = successes_t / observations_t - rate_c
    return Comparison(
        difference=difference,
        relative_difference=_relative(difference, rate_c),
        ci_low=_finite(float(low)),
        ci_high=_finite(float(high)),
        p_value=_finite(float(test.pvalue)),
    )


def compare_means(
    mean_t: float | None,
    variance_t: float | None,
    n_t: int,
    mean_c: float | None,
    variance_c: float | None,
    n_c: int,
) -> Comparison | None:
    """Difference of two means (Welch); None with fewer than two observations per arm."""
    if mean_t is None or mean_c is None or n_t < 2 or n_c < 2:
        return None
    variance_t, variance_c = variance_t or 0.0, variance_c or 0.0
    difference = mean_t - mean_c
    se_squared_t, se_squared_c = variance_t / n_t, variance_c / n_c
    standard_error = math.sqrt(se_squared_t + se_squared_c)
    if standard_error == 0:
        return Comparison(difference, _relative(difference, mean_c), None, None, None)
    test = stats.ttest_ind_from_stats(
        mean_t, math.sqrt(variance_t), n_t, mean_c, math.sqrt(variance_c), n_c, equal_var=False
    )
    dof = (se_squared_t + se_squared_c) ** 2 / (
        se_squared_t**2 / (n_t - 1) + se_squared_c**2 / (n_c - 1)
    )
    margin = float(stats.t.ppf(0.5 + CONFIDENCE / 2, dof)) * standard_error
    return Comparison(
        difference=difference,
        relative_difference=_relative(difference, mean_c),
        ci_low=difference - margin,
        ci_high=difference + margin,
        p_value=_finite(float(test.pvalue)),
    )


def quantile_standard_error(
    lower: float, upper: float, fraction: float, bandwidth: float, n: int
) -> float:
    """SE of a sample quantile: sparsity (Q(p+h) - Q(p-h)) / 2h times sqrt(p(1-p)/n)."""
    sparsity = (upper - lower) / (2 * bandwidth)
    return sparsity * math.sqrt(fraction * (1 - fraction) / n)


def compare_quantiles(
    value_t: float | None,
    se_t: float | None,
    value_c: float | None,
    se_c: float | None,
) -> Comparison | None:
    """Difference of two percentiles under a normal approximation."""
    if value_t is None or value_c is None:
        return None
    difference = value_t - value_c
    if se_t is None or se_c is None or se_t**2 + se_c**2 == 0:
        return Comparison(difference, _relative(difference, value_c), None, None, None)
    standard_error = math.sqrt(se_t**2 + se_c**2)
    z = difference / standard_error
    return Comparison(
        difference=difference,
        relative_difference=_relative(difference, value_c),
        ci_low=difference - _Z * standard_error,
        ci_high=difference + _Z * standard_error,
        p_value=float(2 * stats.norm.sf(abs(z))),
    )


def sample_ratio_mismatch(users: list[int], weights_bps: list[int]) -> SampleRatio | None:
    """Chi-square of users per arm against the weights; None with no users or no weights."""
    total_users, total_weight = sum(users), sum(weights_bps)
    if total_users == 0 or total_weight == 0:
        return None
    if any(n > 0 and w == 0 for n, w in zip(users, weights_bps, strict=True)):
        return SampleRatio(chi_square=math.inf, p_value=0.0, mismatch=True)
    observed = [n for n, w in zip(users, weights_bps, strict=True) if w > 0]
    expected = [total_users * w / total_weight for w in weights_bps if w > 0]
    if len(observed) < 2:
        return SampleRatio(chi_square=0.0, p_value=1.0, mismatch=False)
    result = stats.chisquare(observed, expected)
    p_value = float(result.pvalue)
    return SampleRatio(float(result.statistic), p_value, mismatch=p_value < SRM_ALPHA)
