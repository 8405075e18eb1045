"""The evaluation gate: held-out task pass rate, and how far the policy moved (KL)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from app.serving.parity import CompletionBatch, completion_batch
from app.tasks import Task, check_solution, extract_code, format_response
from trainer.bootstrap import generate_answers, prompt_ids


def heldout_pass_rate(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    tasks: list[Task],
    *,
    max_new_tokens: int,
) -> float:
    """Share of held-out tasks whose greedy answer passes the hidden checks."""
    model.eval()
    answers = generate_answers(
        model,  # type: ignore[arg-type]
        tokenizer,
        [task.request for task in tasks],
        sample=False,
        max_new_tokens=max_new_tokens,
    )
    passed = [
        check_solution(task, extract_code(answer) or "")
        for task, answer in zip(tasks, answers, strict=True)
    ]
    return sum(passed) / len(passed) if passed else 0.0


def reference_batch(tokenizer: PreTrainedTokenizerFast, tasks: list[Task]) -> CompletionBatch:
    """Held-out prompts with their reference answers: fixed text to compare policies on."""
    prompts = [prompt_ids(tokenizer, task.request) for task in tasks]
    answers = [
        [
            *tokenizer.encode(format_response(task.reference), add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
        for task in tasks
    ]
    return completion_batch(prompts, answers)


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
