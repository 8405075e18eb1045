"""The evaluation gate: a held-out pass rate that must not fall, and how far the policy
moved (KL to production on fixed reference text: the held-out set's answers, and its agent
turns — tool calls and final answers).

What "held out" means belongs to the deployment, not to the cycle: the cycle takes any
`HeldOut`. Two exist, chosen by RTRL_TRAIN_EVAL_GATE (`rtrl.gates`): the toy task
family's held-out tasks (`sandbox.task_family`) and production's logged held-out traffic
(`trainer.logged_traffic`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PreTrainedTokenizerFast

from app.serving.parity import CompletionBatch


class HeldOutUnavailable(Exception):
    """The gate has too few held-out cases to judge a candidate; the message says why."""


@dataclass(frozen=True)
class Reference:
    """Fixed prompts with reference answers, on which the gate measures how far a candidate
    moved from production."""

    answers: CompletionBatch
    """The held-out set's own reference answers."""
    agent_turns: CompletionBatch | None
    """Agent turns: prompts with tools declared, answered with a tool call or a final answer;
    None where the held-out set has none."""


class HeldOut(Protocol):
    """What the gate scores a policy on."""

    @property
    def name(self) -> str:
        """The gate's name in the run's evaluation results."""
        ...

    @property
    def withheld_percent(self) -> int:
        """Percent of production's traffic (by sample id) the cycle must not train on,
        because the gate scores it; 0 when the held-out set lies elsewhere."""
        ...

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> Reference:
        """Fixed prompts with reference answers, to measure how far a policy moved. The cycle
        calls it first, once per cycle, before training: a gate on live traffic takes its
        snapshot here, and raises HeldOutUnavailable when it has too few cases."""
        ...

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        """Share of held-out cases the policy passes."""
        ...


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A copy of the weights an update changes (the LoRA's): production's, kept for the KL."""
    return {
        name: parameter.detach().clone()
        for name, parameter in model.named_parameters()
        if parameter.requires_grad
    }


@torch.no_grad()
def next_token_logprobs(model: torch.nn.Module, batch: CompletionBatch) -> torch.Tensor:
    """Full next-token log-distributions at each reference position, [batch, width, vocab]."""
    device = next(model.parameters()).device
    batch = batch.to(device)
    logits = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        logits_to_keep=batch.width + 1,
    ).logits[:, :-1]
    return logits.float().log_softmax(-1)


@torch.no_grad()
def kl_to_production(
    model: torch.nn.Module,
    production: dict[str, torch.Tensor],
    reference: CompletionBatch,
    *,
    rows: int = 8,
) -> float:
    """Mean per-token KL(model ‖ production) over the reference's completion tokens.

    A few rows at a time, with production's weights swapped in for each, so that no
    [rows, width, vocab] distribution of the whole set is ever held (a real vocabulary
    makes that gigabytes)."""
    model.eval()
    parameters = dict(model.named_parameters())
    candidate = {name: parameters[name].detach().clone() for name in production}
    total, tokens = 0.0, 0.0
    for start in range(0, int(reference.input_ids.shape[0]), rows):
        chunk = CompletionBatch(
            *(tensor[start : start + rows] for tensor in vars(reference).values())
        )
        ours = next_token_logprobs(model, chunk)
        for name, weight in production.items():
            parameters[name].copy_(weight)
        theirs = next_token_logprobs(model, chunk)
        for name, weight in candidate.items():
            parameters[name].copy_(weight)
        mask = chunk.completion_mask.to(ours.device)
        kl = (ours.exp() * (ours - theirs)).sum(-1)
        total += float((kl * mask).sum())
        tokens += float(mask.sum())
    return total / max(tokens, 1.0)


@dataclass
class GateResult:
    gate: str
    production_pass_rate: float
    candidate_pass_rate: float
    kl_to_production: float
    """On the held-out set's reference answers."""
    agent_kl_to_production: float | None
    """On held-out agent turns (tool calls, final answers); None when the chat template gives
    none."""
    passed: bool
    reason: str | None

    def as_dict(self) -> dict[str, object]:
        return dict(vars(self))


def gate(
    name: str,
    production_pass_rate: float,
    candidate_pass_rate: float,
    kl_to_production: float,
    agent_kl_to_production: float | None,
    *,
    max_regression: float,
    max_kl: float,
) -> GateResult:
    """A candidate passes unless it regresses on held-out tasks or drifted too far on either
    reference set."""
    reason = None
    if candidate_pass_rate < production_pass_rate - max_regression:
        reason = (
            f"held-out pass rate fell from {production_pass_rate:.3f} to "
            f"{candidate_pass_rate:.3f} (allowed drop {max_regression})"
        )
    elif kl_to_production > max_kl:
        reason = f"KL to production {kl_to_production:.3f} exceeds {max_kl}"
    elif agent_kl_to_production is not None and agent_kl_to_production > max_kl:
        reason = f"KL to production on agent turns {agent_kl_to_production:.3f} exceeds {max_kl}"
    return GateResult(
        gate=name,
        production_pass_rate=production_pass_rate,
        candidate_pass_rate=candidate_pass_rate,
        kl_to_production=kl_to_production,
        agent_kl_to_production=agent_kl_to_production,
        passed=reason is None,
        reason=reason,
    )
