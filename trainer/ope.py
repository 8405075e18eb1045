"""Off-policy estimates of a candidate's metrics from production's logged samples.

Every logged completion carries the token ids production sampled and production's per-token
logprobs. A candidate's sequence-level importance weight is `w = exp(Σ_t log π_cand − log
π_behav)` over the completion, computed in log space. A/B metrics are ratios of per-user sums
(`app.abtest.stats`), so each is estimated as a weighted ratio `Σ w·Y / Σ w·N` (self-normalized
importance sampling, SNIPS, which needs no normalizing constant) and compared with production's
own `Σ Y / Σ N` on the same samples; the interval resamples users, the unit of randomization.

Weights degenerate with length and divergence (the effective sample size falls roughly like
`exp(-2·L·KL_per_token)`), so every estimate carries its diagnostics: the effective sample
size, the largest weight's share, and the Pareto k̂ of the weights' tail (Vehtari et al.,
"Pareto Smoothed Importance Sampling"; above 0.7 the estimate's error is not controlled). An
estimate whose diagnostics fail is reported as unreliable rather than as a number to act on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy.special import logsumexp

PARETO_K_LIMIT = 0.7
"""Above this the weights' tail is too heavy for any importance-sampling estimate."""
MIN_EFFECTIVE_SAMPLES = 30.0
"""Fewer effective samples than this: no interval worth the name."""
MAX_WEIGHT_SHARE = 0.2
"""One completion carrying more of the total weight than this decides the estimate alone."""
NEGLIGIBLE_SPREAD = 1.1
"""Weights all at most this multiple of their mean carry no tail that could move an estimate;
the Pareto k̂, which is blind to scale, would only read the shape of rounding noise."""
CLIP = 10.0
"""Clipped IS: weights (normalized to mean 1) above this are cut to it (biased, low variance)."""


@dataclass(frozen=True)
class WeightDiagnostics:
    """Whether importance weights can be trusted, and why not."""

    samples: int
    effective_samples: float
    effective_fraction: float
    max_weight_share: float
    pareto_k: float | None
    """None with too few samples to fit the tail."""
    unreliable: list[str]
    """Reasons the estimate is not to be acted on; empty when it is reliable."""

    @property
    def reliable(self) -> bool:
        return not self.unreliable


def sequence_log_weights(
    candidate_logprobs: Sequence[Sequence[float]], behaviour_logprobs: Sequence[Sequence[float]]
) -> np.ndarray:
    """log w per completion: the sum over its tokens of candidate minus behaviour logprob."""
    return np.array(
        [
            float(np.sum(np.asarray(c, dtype=np.float64) - np.asarray(b, dtype=np.float64)))
            for c, b in zip(candidate_logprobs, behaviour_logprobs, strict=True)
        ]
    )


def normalized_weights(log_weights: np.ndarray) -> np.ndarray:
    """Weights scaled to mean 1, computed without overflow."""
    if log_weights.size == 0:
        return log_weights
    return np.exp(log_weights - logsumexp(log_weights) + math.log(log_weights.size))


def pareto_k(weights: np.ndarray) -> float | None:
    """The Pareto k̂ of the weights' tail as PSIS computes it (arviz-stats: a generalized Pareto
    fitted by Zhang and Stephens' method to the largest min(n/5, 3√n) weights); None with
    fewer than 5 tail weights. Weights that underflowed to 0 count as the smallest float."""
    n = weights.size
    if int(min(n / 5, 3 * math.sqrt(n))) < 5:
        return None
    # Imported here: arviz-stats takes a second or two to import and only the trainer needs it.
    from arviz_stats.base import array_stats

    try:
        _, k = array_stats.psislw(np.log(np.maximum(weights, np.finfo(np.float64).tiny)))
    except ValueError as error:
        if "same" not in str(error):
            raise
        return 0.0  # a tail of equal weights: bounded, nothing heavy about it
    return float(k)


def weight_diagnostics(weights: np.ndarray) -> WeightDiagnostics:
    """Effective sample size, largest share and Pareto k̂ of (unnormalized) weights."""
    n = int(weights.size)
    total = float(weights.sum())
    if n == 0 or total <= 0:
        return WeightDiagnostics(n, 0.0, 0.0, 1.0, None, ["no samples"])
    ess = total**2 / float(np.square(weights).sum())
    share = float(weights.max()) / total
    k = pareto_k(weights)
    unreliable = []
    if k is None:
        unreliable.append(f"too few samples ({n}) to check the weights' tail")
    elif k > PARETO_K_LIMIT and share * n > NEGLIGIBLE_SPREAD:
        unreliable.append(f"Pareto k̂ {k:.2f} > {PARETO_K_LIMIT}")
    if ess < MIN_EFFECTIVE_SAMPLES:
        unreliable.append(f"effective sample size {ess:.1f} < {MIN_EFFECTIVE_SAMPLES:g}")
    if share > MAX_WEIGHT_SHARE:
        unreliable.append(f"one completion carries {share:.0%} of the weight")
    return WeightDiagnostics(n, ess, ess / n, share, k, unreliable)


@dataclass(frozen=True)
class RatioPrediction:
    """A metric's predicted candidate-minus-production difference on the logged samples."""

    production: float
    candidate: float
    difference: float
    ci_low: float | None
    ci_high: float | None
    standard_error: float | None
    clipped_difference: float
    """The same with weights clipped at `CLIP` (mean 1): biased toward 0, lower variance."""
    users: int
    observations: int
    diagnostics: WeightDiagnostics

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"reliable": self.diagnostics.reliable}


def predict_ratio(
    numerators: np.ndarray,
    denominators: np.ndarray,
    weights: np.ndarray,
    users: Sequence[str],
    *,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> RatioPrediction | None:
    """`Σ w·Y / Σ w·N − Σ Y / Σ N` over samples whose N > 0, with a percentile interval from
    resampling users (each user's samples together); None when no sample counts."""
    counted = denominators > 0
    if not counted.any():
        return None
    y, n, w = numerators[counted], denominators[counted], weights[counted]
    who = np.asarray(users, dtype=object)[counted]
    clipped = np.minimum(w / w.mean(), CLIP)
    production = float(y.sum() / n.sum())
    candidate = float((w * y).sum() / (w * n).sum())
    clipped_candidate = float((clipped * y).sum() / (clipped * n).sum())

    # Per-user sums, then users drawn with replacement.
    _, user_index = np.unique(who, return_inverse=True)
    count = int(user_index.max()) + 1
    per_user = np.stack(
        [np.bincount(user_index, values, minlength=count) for values in (w * y, w * n, y, n)]
    )
    rng = np.random.default_rng(seed)
    draws = rng.multinomial(count, np.full(count, 1 / count), size=resamples)
    wy, wn, py, pn = (draws @ per_user.T.astype(np.float64)).T
    with np.errstate(invalid="ignore", divide="ignore"):
        differences = wy / wn - py / pn
    differences = differences[np.isfinite(differences)]
    low = high = se = None
    if count > 1 and differences.size >= resamples // 2:
        tail = (1 - confidence) / 2 * 100
        low, high = (float(v) for v in np.percentile(differences, [tail, 100 - tail]))
        se = float(differences.std(ddof=1))
    return RatioPrediction(
        production=production,
        candidate=candidate,
        difference=candidate - production,
        ci_low=low,
        ci_high=high,
        standard_error=se,
        clipped_difference=clipped_candidate - production,
        users=count,
        observations=int(counted.sum()),
        diagnostics=weight_diagnostics(w * n),
    )
