"""Token-level clipped policy gradient with truncated importance weights."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def advantages(rewards: Sequence[float], groups: Sequence[object]) -> torch.Tensor:
    """Rewards minus their prompt group's mean (the batch mean for singletons), normalised."""
    reward = torch.tensor(rewards, dtype=torch.float32)
    baseline = torch.full_like(reward, reward.mean().item())
    members: dict[object, list[int]] = {}
    for index, group in enumerate(groups):
        members.setdefault(group, []).append(index)
    for indices in members.values():
        if len(indices) > 1:
            baseline[indices] = reward[indices].mean()
    centred = reward - baseline
    std = centred.std() if len(rewards) > 1 else torch.tensor(0.0)
    return centred / (std + 1e-6) if std > 1e-8 else centred


@dataclass
class LossStats:
    loss: float
    mean_ratio: float
    clip_fraction: float
    mean_tis_weight: float
    kl_to_base: float


def policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_epsilon: float,
    tis_cap: float,
    base_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped surrogate on `logprobs / old_logprobs`, weighted by min(old/behaviour, cap).

    `old_logprobs` are the trainer's own logprobs before the update and `behaviour_logprobs`
    the ones vLLM logged when it sampled: the truncated weight corrects the small mismatch
    between the two engines without letting a stale or mismatched token blow up the step.
    All tensors are [batch, tokens]; `advantages` is [batch]; `mask` marks real tokens.
    """
    mask = mask.float()
    tokens = mask.sum().clamp(min=1)
    ratio = torch.exp(logprobs - old_logprobs)
    tis_weight = torch.exp(old_logprobs - behaviour_logprobs).clamp(max=tis_cap).detach()
    advantage = advantages[:, None]
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantage
    surrogate = torch.minimum(unclipped, clipped) * tis_weight
    loss = -(surrogate * mask).sum() / tokens

    kl = torch.zeros(())
    if base_logprobs is not None:
        # k3 estimator of KL(policy ‖ base): non-negative, low variance.
        log_ratio = base_logprobs - logprobs
        kl = ((torch.exp(log_ratio) - log_ratio - 1) * mask).sum() / tokens
        loss = loss + kl_coef * kl

    with torch.no_grad():
        clipped_tokens = ((ratio - 1).abs() > clip_epsilon).float()
        stats = LossStats(
            loss=float(loss),
            mean_ratio=float((ratio * mask).sum() / tokens),
            clip_fraction=float((clipped_tokens * mask).sum() / tokens),
            mean_tis_weight=float((tis_weight * mask).sum() / tokens),
            kl_to_base=float(kl),
        )
    return loss, stats
