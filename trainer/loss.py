"""Token-level clipped policy gradient with truncated importance weights, advantages against a
baseline per state, and a KL anchor to production."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from trainer.config import Baseline
from trainer.data import TrainingSample

MIN_PEERS = 3
"""A stratum gives a sample its baseline when it holds at least this many samples of other
runs (four with the sample's own); fewer, and a coarser stratum does."""


def state_strata(sample: TrainingSample) -> tuple[Hashable, ...]:
    """The strata of what the model saw before it answered, finest first, the batch last:
    agent traffic or one-turn chat, the turn of its run (0, 1, 2, 3+), whether the run asked
    for an edit. Never what it answered (a tool call or a final answer is the action): a
    baseline that depends on the action biases the gradient."""
    tools, turn = sample.tools_declared, min(sample.turn_index, 3)
    return ((tools, turn, sample.edit_requested), (tools, turn), (tools,), ())


def state_baselines(samples: Sequence[TrainingSample], min_peers: int = MIN_PEERS) -> torch.Tensor:
    """Each sample's baseline: the mean reward of its peers in the finest stratum that has
    `min_peers` of them — the samples of the same prompt, else of the same state
    (`state_strata`) — else of the whole batch.

    Peers are the samples of other runs: a run's turns share its outcome (an edit's
    discounted credit, a follow-up charged to every turn), so a turn of the sample's own run,
    or the sample itself, would make its baseline depend on its action.
    """
    runs: list[Hashable] = [s.trajectory_id or ("sample", i) for i, s in enumerate(samples)]
    strata = [(("prompt", tuple(s.prompt_token_ids)), *state_strata(s)) for s in samples]
    total: dict[Hashable, float] = defaultdict(float)
    count: dict[Hashable, int] = defaultdict(int)
    run_total: dict[tuple[Hashable, Hashable], float] = defaultdict(float)
    run_count: dict[tuple[Hashable, Hashable], int] = defaultdict(int)
    for sample, run, keys in zip(samples, runs, strata, strict=True):
        for key in keys:
            total[key] += sample.reward
            count[key] += 1
            run_total[key, run] += sample.reward
            run_count[key, run] += 1
    baselines = []
    for run, keys in zip(runs, strata, strict=True):
        baseline = total[()] / max(count[()], 1)  # the whole batch is this one run
        for key in keys:
            peers = count[key] - run_count[key, run]
            if peers >= min_peers or (key == () and peers > 0):
                baseline = (total[key] - run_total[key, run]) / peers
                break
        baselines.append(baseline)
    return torch.tensor(baselines, dtype=torch.float32)


def batch_baselines(samples: Sequence[TrainingSample]) -> torch.Tensor:
    """The former baseline: the mean reward of the sample's prompt group when the prompt has
    several samples, else the batch mean, whatever the state."""
    reward = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    baseline = torch.full_like(reward, reward.mean().item())
    members: dict[tuple[int, ...], list[int]] = {}
    for index, sample in enumerate(samples):
        members.setdefault(tuple(sample.prompt_token_ids), []).append(index)
    for indices in members.values():
        if len(indices) > 1:
            baseline[indices] = reward[indices].mean()
    return baseline


def advantages(samples: Sequence[TrainingSample], baseline: Baseline = "state") -> torch.Tensor:
    """Each sample's reward minus its baseline, divided by one scale for the whole batch.

    A sample's reward already is its turn's return as its run credits it, so nothing is
    discounted again here: `run_rewards` charges the turn its own conduct (latency, malformed
    calls, errors) and credits it with the outcome of the edit it led to, discounted per turn
    between them (under formulas 4 and 5 the final answer shares its run's last edit, and
    under 5 a follow-up is charged to every turn); a later turn's conduct stays that turn's.
    The scale (the centred values' standard deviation) is one number for the whole batch: it
    changes the step's size, never its direction.
    """
    reward = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    centred = reward - (
        state_baselines(samples) if baseline == "state" else batch_baselines(samples)
    )
    std = centred.std() if len(samples) > 1 else torch.tensor(0.0)
    return centred / (std + 1e-6) if std > 1e-8 else centred


def production_kl(logprobs: torch.Tensor, production_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(policy ‖ production) on sampled tokens: k3's value with k2's gradient.

    With `log_ratio = production − policy`, k3 = e^log_ratio − log_ratio − 1 is a non-negative,
    low-variance estimate of the KL, but its gradient as a loss is that of the reverse KL;
    k2 = log_ratio² / 2 has the KL's own gradient in expectation. The straight-through sum
    takes k3's value and k2's gradient (verl's "k3+"); the value is clamped, so a token
    production found unlikely cannot blow up the loss it reports.
    """
    log_ratio = production_logprobs.detach() - logprobs
    k2 = 0.5 * log_ratio.square()
    bounded = log_ratio.detach().clamp(-20.0, 20.0)
    k3 = (torch.exp(bounded) - bounded - 1).clamp(max=10.0)
    return k2 + (k3 - k2).detach()


@dataclass
class LossStats:
    loss: float
    mean_ratio: float
    clip_fraction: float
    mean_tis_weight: float
    kl_to_production: float


def policy_gradient_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_epsilon: float,
    tis_cap: float,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """PPO-clipped surrogate on `logprobs / old_logprobs`, weighted by min(old/behaviour, cap),
    plus `kl_coef` × the KL to production.

    `old_logprobs` are the trainer's own logprobs before the update — production's, since a
    cycle trains production's adapter — and `behaviour_logprobs` the ones vLLM logged when it
    sampled: the truncated weight corrects the small mismatch between the two engines without
    letting a stale or mismatched token blow up the step. The KL term keeps tokens no
    advantage speaks for (the end of an answer, a tool's name) where production had them.
    All tensors are [batch, tokens]; `advantages` is [batch] (a row's) or [batch, tokens] (each
    token its turn's, as merged rows carry them); `mask` marks the trained tokens.
    """
    mask = mask.float()
    tokens = mask.sum().clamp(min=1)
    ratio = torch.exp(logprobs - old_logprobs)
    tis_weight = torch.exp(old_logprobs - behaviour_logprobs).clamp(max=tis_cap).detach()
    advantage = advantages if advantages.dim() == 2 else advantages[:, None]
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * advantage
    surrogate = torch.minimum(unclipped, clipped) * tis_weight
    loss = -(surrogate * mask).sum() / tokens
    kl = (production_kl(logprobs, old_logprobs) * mask).sum() / tokens
    if kl_coef > 0:
        loss = loss + kl_coef * kl

    with torch.no_grad():
        clipped_tokens = ((ratio - 1).abs() > clip_epsilon).float()
        stats = LossStats(
            loss=float(loss),
            mean_ratio=float((ratio * mask).sum() / tokens),
            clip_fraction=float((clipped_tokens * mask).sum() / tokens),
            mean_tis_weight=float((tis_weight * mask).sum() / tokens),
            kl_to_production=float(kl),
        )
    return loss, stats
