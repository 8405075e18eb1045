"""Treatment-versus-control statistics over users, and the sample-ratio check.

Users are randomized, so users are the unit of analysis: a request-level test treats the
many requests of one user as independent and, with users as different as ours, calls about
half of A/A experiments significant (`python -m bench.ab_validity`). Every metric is a ratio
of two per-user sums (kept = sum of kept shares / final rewards with a kept value; latency =
sum of latencies / requests; ...), so each arm's estimate is R = sum(Y_u) / sum(N_u) over its
users u, and its variance comes from the delta method over users (Deng, Knoblich & Lu,
"Applying the Delta Method in Metric Analytics", KDD 2018; GrowthBook's `variance_of_ratios`):

    Var(R) = (var(Y)/mu_N^2 - 2 mu_Y cov(Y, N)/mu_N^3 + mu_Y^2 var(N)/mu_N^4) / K

with per-user means, variances and covariance over the arm's K users. The difference of two
arms uses the sum of their variances and Welch's t with the Welch–Satterthwaite degrees of
freedom (`scipy.stats.t`); the relative lift R_t/R_c - 1 its own delta-method variance.

CUPED (Deng, Xu, Kohavi & Walker, WSDM 2013), for ratio metrics as GrowthBook's
`RegressionAdjustedRatioStatistic` does it: each user's pre-experiment numerator X_u and
denominator M_u of the same metric give the covariate P = sum(X)/sum(M); the estimate is
R - theta * P, with theta = pooled Cov(R, P) / pooled Var(P) (the variance-minimising
coefficient), and the variance from the 4x4 covariance of (Y, N, X, M) by the delta method.

Percentiles (of request latency) keep their request-level value, read from the arm's
histogram; their standard error is the iid one (Koenker's sparsity estimate, "Quantile
Regression" 2005, §3.4) times the design effect of the user clusters at the quantile: the
delta-method variance of the share of requests below it, as Deng et al. 2018 treat
percentile metrics (GrowthBook's `QuantileClusteredStatistic`), over USER_GROUPS random
groups of users (whole users per group, so the groups are independent clusters), against
its binomial variance.

The sample-ratio check (Fabijan et al., KDD 2019) counts each user once, in the arm of their
first exposure, against the weights in force at that time, flagged below p = 0.001.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from app.abtest.repository import RATIOS, ArmSummary, Moments
from app.abtest.rollups import GROUP_BUCKET, latency_quantile

CONFIDENCE = 0.95
SRM_ALPHA = 0.001
_Z = float(stats.norm.ppf(0.5 + CONFIDENCE / 2))


@dataclass(frozen=True)
class Comparison:
    """Treatment minus control: the difference and relative lift, intervals, p-value."""

    difference: float
    relative_difference: float | None
    ci_low: float | None
    ci_high: float | None
    p_value: float | None
    relative_ci_low: float | None = None
    relative_ci_high: float | None = None
    variance_reduction: float | None = None
    """With CUPED: the share of the unadjusted difference's variance it removed."""


@dataclass(frozen=True)
class RatioEstimate:
    """One arm's ratio metric over its users, and the pieces of its delta-method variance."""

    users: int
    value: float
    """R = sum(Y) / sum(N)."""
    pre_value: float
    """P = sum(X) / sum(M), the pre-experiment ratio (0 without CUPED)."""
    covariance: np.ndarray
    """Covariance of (R, P) estimates (2x2; P's row and column 0 without CUPED)."""


def ratio_estimate(moments: Moments, metric: str, cuped: bool = False) -> RatioEstimate | None:
    """An arm's ratio and its delta-method covariance; None with under two users or no data."""
    return _ratio(moments, *RATIOS[metric], cuped=cuped)


def user_ratio(per_user: Sequence[tuple[float, float]]) -> RatioEstimate | None:
    """The ratio of per-user sums, (numerator, denominator) for each user, with its
    delta-method variance over users; None with under two users or no data."""
    sums = {"y": sum(y for y, _ in per_user), "n": sum(n for _, n in per_user)}
    squares = {"y": sum(y * y for y, _ in per_user), "n": sum(n * n for _, n in per_user)}
    products = {("y", "n"): sum(y * n for y, n in per_user)}
    return _ratio(Moments(len(per_user), sums, squares, products), "y", "n")


def _ratio(
    moments: Moments, numerator: str, denominator: str, *, cuped: bool = False
) -> RatioEstimate | None:
    columns = [numerator, denominator]
    if cuped:
        columns += [f"pre_{numerator}", f"pre_{denominator}"]
    k = moments.users
    if k < 2:
        return None
    means = np.array([moments.sum(c) / k for c in columns])
    if means[1] == 0 or (cuped and means[3] == 0):
        return None
    cov = np.array(
        [
            [
                (moments.product(a, b) - k * means[i] * means[j]) / (k - 1)
                for j, b in enumerate(columns)
            ]
            for i, a in enumerate(columns)
        ]
    )
    gradient = np.zeros((2, len(columns)))
    gradient[0, :2] = [1 / means[1], -means[0] / means[1] ** 2]
    if cuped:
        gradient[1, 2:] = [1 / means[3], -means[2] / means[3] ** 2]
    covariance = gradient @ cov @ gradient.T / k
    # The moments' cancellation can leave a zero variance a hair below 0 (every user at the
    # same ratio): a variance is never negative.
    np.fill_diagonal(covariance, np.maximum(np.diag(covariance), 0.0))
    return RatioEstimate(
        users=k,
        value=float(means[0] / means[1]),
        pre_value=float(means[2] / means[3]) if cuped else 0.0,
        covariance=covariance,
    )


def _t_test(
    difference: float, variances: tuple[float, float], users: tuple[int, int]
) -> tuple[float | None, float | None, float | None]:
    """(low, high, p) of a difference with Welch–Satterthwaite degrees of freedom."""
    variance = sum(variances)
    if not variance > 0 or not math.isfinite(variance):
        return None, None, None
    dof = variance**2 / sum(v**2 / (n - 1) for v, n in zip(variances, users, strict=True))
    standard_error = math.sqrt(variance)
    margin = float(stats.t.ppf(0.5 + CONFIDENCE / 2, dof)) * standard_error
    p_value = float(2 * stats.t.sf(abs(difference) / standard_error, dof))
    return difference - margin, difference + margin, p_value


def compare_ratios(
    treatment: RatioEstimate, control: RatioEstimate, cuped: bool = False
) -> Comparison:
    """Treatment minus control by the delta method; with `cuped`, regression-adjusted."""
    theta = 0.0
    if cuped:
        pre_variance = treatment.covariance[1, 1] + control.covariance[1, 1]
        if pre_variance > 0:
            theta = float(treatment.covariance[0, 1] + control.covariance[0, 1]) / pre_variance
    adjust = np.array([1.0, -theta])
    variances = (
        float(adjust @ treatment.covariance @ adjust),
        float(adjust @ control.covariance @ adjust),
    )
    difference = (treatment.value - theta * treatment.pre_value) - (
        control.value - theta * control.pre_value
    )
    users = (treatment.users, control.users)
    low, high, p_value = _t_test(difference, variances, users)
    relative = relative_low = relative_high = None
    if control.value != 0:
        relative = difference / control.value
        # d relative / d (R_c, P_c): the control's value is also the denominator.
        control_gradient = np.array(
            [-(control.value + difference) / control.value**2, theta / control.value]
        )
        relative_variances = (
            variances[0] / control.value**2,
            float(control_gradient @ control.covariance @ control_gradient),
        )
        relative_low, relative_high, _ = _t_test(relative, relative_variances, users)
    reduction = None
    if cuped:
        plain = treatment.covariance[0, 0] + control.covariance[0, 0]
        reduction = 1 - sum(variances) / plain if plain > 0 else None
    return Comparison(
        difference=difference,
        relative_difference=relative,
        ci_low=low,
        ci_high=high,
        p_value=p_value,
        relative_ci_low=relative_low,
        relative_ci_high=relative_high,
        variance_reduction=reduction,
    )


def compare_metric(
    treatment: ArmSummary, control: ArmSummary, metric: str, cuped: bool = False
) -> Comparison | None:
    """A ratio metric of two arms compared over users; None where it cannot be estimated."""
    treated = ratio_estimate(treatment.moments, metric, cuped)
    baseline = ratio_estimate(control.moments, metric, cuped)
    if treated is None or baseline is None:
        return None
    return compare_ratios(treated, baseline, cuped)


@dataclass(frozen=True)
class QuantileEstimate:
    value: float
    standard_error: float | None
    design_effect: float | None
    """Variance over the iid variance, from the user groups at the quantile."""


def quantile_standard_error(
    lower: float, upper: float, fraction: float, bandwidth: float, n: int
) -> float:
    """iid SE of a sample quantile: sparsity (Q(p+h) - Q(p-h)) / 2h times sqrt(p(1-p)/n)."""
    sparsity = (upper - lower) / (2 * bandwidth)
    return sparsity * math.sqrt(fraction * (1 - fraction) / n)


def design_effect(groups: dict[int, list[tuple[int, int]]], edge: int) -> float | None:
    """Clustered over binomial variance of the share of requests in group buckets < `edge`."""
    below = np.array([sum(c for b, c in cells if b < edge) for cells in groups.values()], float)
    total = np.array([sum(c for _, c in cells) for cells in groups.values()], float)
    g, n = len(total), total.sum()
    if g < 2 or n == 0:
        return None
    share = below.sum() / n
    if not 0 < share < 1:
        return None
    mean_i, mean_n = below.mean(), total.mean()
    var_i, var_n = below.var(ddof=1), total.var(ddof=1)
    cov = float(np.cov(below, total, ddof=1)[0, 1])
    clustered = (
        var_i / mean_n**2 - 2 * mean_i * cov / mean_n**3 + mean_i**2 * var_n / mean_n**4
    ) / g
    return float(clustered / (share * (1 - share) / n))


def quantile_estimate(
    summary: ArmSummary, fraction: float, bandwidth: float
) -> QuantileEstimate | None:
    """An arm's latency quantile with its user-clustered standard error."""
    histogram = summary.latency_histogram
    value = latency_quantile(histogram, fraction)
    if value is None:
        return None
    lower = latency_quantile(histogram, fraction - bandwidth)
    upper = latency_quantile(histogram, fraction + bandwidth)
    requests = sum(count for _, count in histogram)
    if lower is None or upper is None or requests < 2:
        return QuantileEstimate(value, None, None)
    iid = quantile_standard_error(lower, upper, fraction, bandwidth, requests)
    deff = _nearest_design_effect(summary, fraction)
    if deff is None:
        return QuantileEstimate(value, iid, None)
    return QuantileEstimate(value, iid * math.sqrt(deff), deff)


def _nearest_design_effect(summary: ArmSummary, fraction: float) -> float | None:
    """The design effect at the group-bucket edge whose share of requests is nearest `fraction`."""
    histogram = summary.latency_histogram
    total = sum(count for _, count in histogram)
    candidates = []
    for edge in {bucket // GROUP_BUCKET + step for bucket, _ in histogram for step in (0, 1)}:
        share = sum(c for b, c in histogram if b < edge * GROUP_BUCKET) / total
        if 0 < share < 1:
            candidates.append((abs(share - fraction), edge))
    if not candidates or not summary.latency_groups:
        return None
    _, edge = min(candidates)
    return design_effect(summary.latency_groups, edge)


def compare_quantiles(
    treatment: QuantileEstimate | None, control: QuantileEstimate | None
) -> Comparison | None:
    """Difference of two percentiles under a normal approximation."""
    if treatment is None or control is None:
        return None
    difference = treatment.value - control.value
    relative = difference / control.value if control.value else None
    se_t, se_c = treatment.standard_error, control.standard_error
    if se_t is None or se_c is None or se_t**2 + se_c**2 == 0:
        return Comparison(difference, relative, None, None, None)
    standard_error = math.sqrt(se_t**2 + se_c**2)
    relative_se = math.sqrt(
        se_t**2 / control.value**2 + treatment.value**2 * se_c**2 / control.value**4
    )
    return Comparison(
        difference=difference,
        relative_difference=relative,
        ci_low=difference - _Z * standard_error,
        ci_high=difference + _Z * standard_error,
        p_value=float(2 * stats.norm.sf(abs(difference) / standard_error)),
        relative_ci_low=None if relative is None else relative - _Z * relative_se,
        relative_ci_high=None if relative is None else relative + _Z * relative_se,
    )


@dataclass(frozen=True)
class SampleRatio:
    chi_square: float
    p_value: float
    mismatch: bool


def sample_ratio_mismatch(
    periods: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> SampleRatio | None:
    """Chi-square of users per arm at first exposure against the weights then in force.

    `periods`: per ramp period, (users first exposed per arm, weights per arm). Each period
    with users and more than one weighted arm adds its cells; None with no users at all.
    """
    observed: list[float] = []
    expected: list[float] = []
    constraints = 0
    for users, weights in periods:
        total_users, total_weight = sum(users), sum(weights)
        if total_users == 0 or total_weight == 0:
            continue
        if any(n > 0 and w == 0 for n, w in zip(users, weights, strict=True)):
            return SampleRatio(chi_square=math.inf, p_value=0.0, mismatch=True)
        cells = [(n, total_users * w / total_weight) for n, w in zip(users, weights, strict=True)]
        cells = [(n, e) for n, e in cells if e > 0]
        if len(cells) < 2:
            continue
        observed += [n for n, _ in cells]
        expected += [e for _, e in cells]
        constraints += 1
    if not observed:
        total = sum(sum(users) for users, _ in periods)
        return SampleRatio(0.0, 1.0, False) if total else None
    # One degree of freedom is lost per period (its users are fixed), not just one overall.
    result = stats.chisquare(observed, expected, ddof=constraints - 1)
    p_value = float(result.pvalue)
    return SampleRatio(float(result.statistic), p_value, mismatch=p_value < SRM_ALPHA)
