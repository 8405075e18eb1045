"""Serving/training drift, measured: how far vLLM's logged logprobs are from the trainer's.

The same weights give different logprobs in two engines (kernels, reduction order, bf16
rounding). The metrics are the rollout/training mismatch metrics verl and the TIS papers
report, over every completion token of the batch:
- mean and max |logged − recomputed| logprob;
- KL(vLLM ‖ trainer) per token, by the k3 estimator on the tokens vLLM sampled
  (r = π_trainer / π_vLLM, k3 = r − 1 − log r: non-negative, low variance);
- the share of tokens whose truncated importance weight min(r, tis_cap) hit its cap.
A cycle is refused when one exceeds its limit. The defaults depend on the precision: in fp32
the two engines agree to ~1e-6, so any visible difference is a bug; in bf16 a healthy pair
differs by ~1e-2 per token on average, with single-token spikes of several nats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class DriftLimits:
    """Largest value of each metric a cycle may train with (inf: no limit)."""

    max_abs: float
    mean_abs: float
    kl: float
    capped_share: float


DEFAULT_DRIFT_LIMITS = {
    # fp32 engines agree to ~1e-6 (measured on CPU); 1e-3 anywhere is a real difference.
    "fp32": DriftLimits(max_abs=1e-3, mean_abs=1e-4, kl=1e-6, capped_share=0.0),
    # bf16: single tokens differ by nats (so no max), the batch's averages stay small.
    "bf16": DriftLimits(max_abs=math.inf, mean_abs=0.1, kl=0.02, capped_share=0.02),
    # fp16 keeps 3 more mantissa bits than bf16: its mismatch is several times smaller.
    "fp16": DriftLimits(max_abs=math.inf, mean_abs=0.03, kl=0.005, capped_share=0.01),
}


def drift_limits(
    dtype: str,
    *,
    max_abs: float | None = None,
    mean_abs: float | None = None,
    kl: float | None = None,
    capped_share: float | None = None,
) -> DriftLimits:
    """The limits for a policy computed in `dtype` (bf16, fp16, fp32), with overrides."""
    default = DEFAULT_DRIFT_LIMITS[dtype]
    return DriftLimits(
        max_abs=default.max_abs if max_abs is None else max_abs,
        mean_abs=default.mean_abs if mean_abs is None else mean_abs,
        kl=default.kl if kl is None else kl,
        capped_share=default.capped_share if capped_share is None else capped_share,
    )


@dataclass(frozen=True)
class Drift:
    """Mismatch between vLLM's logged logprobs and the trainer's, over `tokens` tokens."""

    tokens: int
    mean_abs: float
    max_abs: float
    kl: float
    capped_share: float
    mean_weight: float
    """Mean importance weight π_trainer / π_vLLM before truncation (1 when they agree)."""

    def as_stats(self) -> dict[str, float]:
        """The run's `stats` entries, prefixed `drift_`."""
        return {f"drift_{name}": value for name, value in asdict(self).items()}

    def refusal(self, limits: DriftLimits) -> str | None:
        """Why a cycle must not train on this batch, or None (NaN never passes)."""
        checks = [
            ("max |logged - recomputed| logprob", self.max_abs, limits.max_abs),
            ("mean |logged - recomputed| logprob", self.mean_abs, limits.mean_abs),
            ("KL(vLLM || trainer) per token", self.kl, limits.kl),
            ("share of importance weights at their cap", self.capped_share, limits.capped_share),
        ]
        over = [
            f"{name} {value:.3g} exceeds {limit:.3g}"
            for name, value, limit in checks
            if not value <= limit
        ]
        if not over:
            return None
        return f"serving/training drift over {self.tokens} tokens: " + "; ".join(over)


def measure_drift(
    logged: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]], *, tis_cap: float
) -> Drift:
    """The drift metrics over every token of every completion."""
    if len(logged) != len(recomputed):
        raise ValueError(f"{len(logged)} logged sequences but {len(recomputed)} recomputed")
    for index, (served, ours) in enumerate(zip(logged, recomputed, strict=True)):
        if len(served) != len(ours):
            raise ValueError(
                f"sequence {index}: {len(served)} logged logprobs but {len(ours)} recomputed"
            )
    vllm = torch.tensor([lp for row in logged for lp in row], dtype=torch.float64)
    trainer = torch.tensor([lp for row in recomputed for lp in row], dtype=torch.float64)
    if vllm.numel() == 0:
        return Drift(tokens=0, mean_abs=0.0, max_abs=0.0, kl=0.0, capped_share=0.0, mean_weight=1.0)
    log_ratio = trainer - vllm
    ratio = log_ratio.exp()
    return Drift(
        tokens=vllm.numel(),
        mean_abs=float(log_ratio.abs().mean()),
        max_abs=float(log_ratio.abs().max()),
        kl=float((ratio - 1 - log_ratio).mean()),
        capped_share=float((ratio >= tis_cap).double().mean()),
        mean_weight=float(ratio.mean()),
    )
