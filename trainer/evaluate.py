"""The evaluation gate: a held-out pass rate that must not fall, and how far the policy
moved (KL to production on fixed reference text).

What "held out" means belongs to the deployment, not to the cycle: the cycle takes any
`HeldOut` (the toy task family's is `trainer.task_family.TaskFamilyHeldOut`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerFast

from app.serving.parity import CompletionBatch


class HeldOut(Protocol):
    """What the gate scores a policy on."""

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> CompletionBatch:
        """Fixed prompts with reference answers, to measure how far a policy moved."""
        ...

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        """Share of held-out tasks the policy passes."""
        ...


@torch.no_grad()
def next_token_logprobs(model: torch.nn.Module, batch: CompletionBatch) -> torch.Tensor:
    """Full next-token log-distributions at each reference position, [batch, width, vocab]."""
    model.eval()
    device = next(model.parameters()).device
    batch = batch.to(device)
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.width + 1,
    ).logits[:, :-1]
    return logits.float().log_softmax(-1).cpu()


def mean_kl(policy: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean per-token KL(policy ‖ reference) over the masked positions."""
    kl = (policy.exp() * (policy - reference)).sum(-1)
    return float((kl * mask).sum() / mask.sum().clamp(min=1))


@dataclass
class GateResult:
    production_pass_rate: float
    candidate_pass_rate: float
    kl_to_production: float
    passed: bool
    reason: str | None

    def as_dict(self) -> dict[str, object]:
        return dict(vars(self))


def gate(
    production_pass_rate: float,
    candidate_pass_rate: float,
    kl_to_production: float,
    *,
    max_regression: float,
    max_kl: float,
) -> GateResult:
    """A candidate passes unless it regresses on held-out tasks or drifted too far."""
    reason = None
    if candidate_pass_rate < production_pass_rate - max_regression:
        reason = (
            f"held-out pass rate fell from {production_pass_rate:.3f} to "
            f"{candidate_pass_rate:.3f} (allowed drop {max_regression})"
        )
    elif kl_to_production > max_kl:
        reason = f"KL to production {kl_to_production:.3f} exceeds {max_kl}"
    return GateResult(
        production_pass_rate=production_pass_rate,
        candidate_pass_rate=candidate_pass_rate,
        kl_to_production=kl_to_production,
        passed=reason is None,
        reason=reason,
    )
