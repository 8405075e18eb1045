"""Recompute served logprobs with transformers (+ peft) to catch serving/training drift."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel


def default_device() -> torch.device:
    """CUDA when available, else CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_policy(
    model_dir: Path, adapter_dir: Path | None = None, *, device: torch.device | None = None
) -> torch.nn.Module:
    """The base model in fp32, with the PEFT LoRA adapter applied if given, in eval mode."""
    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    return model.to(device or default_device()).eval()


def _batches(lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped longest first so that each padded batch stays under the budget."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    for index in order:
        # Longest first: the batch's padded width is its first member's length.
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_batch_tokens:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


@dataclass(frozen=True)
class CompletionBatch:
    """Prompt+completion sequences, left-padded so every completion ends at the last column.

    `completion_mask[b, t]` marks real completion tokens among the last `width` positions;
    `targets` holds those tokens (0 where masked).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    completion_mask: torch.Tensor
    temperatures: torch.Tensor
    """The sampling temperature of each row: logits are divided by it, as vLLM's were."""

    @property
    def width(self) -> int:
        return int(self.targets.shape[1])

    def to(self, device: torch.device) -> CompletionBatch:
        return CompletionBatch(*(tensor.to(device) for tensor in vars(self).values()))


def completion_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperatures: Sequence[float] | None = None,
) -> CompletionBatch:
    """Left-pad prompt+completion pairs into one batch (temperature 1 unless given)."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    if any(len(prompt) == 0 for prompt in prompts):
        raise ValueError("every prompt needs at least one token")
    sequences = [[*p, *c] for p, c in zip(prompts, completions, strict=True)]
    width = max(len(s) for s in sequences)
    completion_width = max(1, max(len(c) for c in completions))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    targets = torch.zeros(len(sequences), completion_width, dtype=torch.long)
    completion_mask = torch.zeros(len(sequences), completion_width, dtype=torch.bool)
    for row, (sequence, completion) in enumerate(zip(sequences, completions, strict=True)):
        input_ids[row, width - len(sequence) :] = torch.tensor(sequence)
        attention_mask[row, width - len(sequence) :] = 1
        if completion:
            targets[row, completion_width - len(completion) :] = torch.tensor(completion)
            completion_mask[row, completion_width - len(completion) :] = True
    # Positions restart at 0 on each row's first real token, as in vLLM.
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    temperature = torch.tensor(
        [1.0] * len(sequences) if temperatures is None else list(temperatures),
        dtype=torch.float32,
    )
    return CompletionBatch(
        input_ids, attention_mask, position_ids, targets, completion_mask, temperature
    )


def batch_logprobs(
    model: torch.nn.Module | PreTrainedModel, batch: CompletionBatch
) -> torch.Tensor:
    """Logprobs of the completion tokens, shape [batch, width]; differentiable."""
    # Left padding aligns every completion at the end, so only the last positions need
    # logits: the logits before each completion token predict that token.
    logits = (
        model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.width + 1,
        )
        .logits[:, :-1]
        .float()
    )
    logits = logits / batch.temperatures[:, None, None]
    picked = logits.log_softmax(-1).gather(-1, batch.targets[..., None]).squeeze(-1)
    return picked.masked_fill(~batch.completion_mask, 0.0)


@torch.inference_mode()
def completion_logprobs(
    model: torch.nn.Module | PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperatures: Sequence[float] | None = None,
    max_batch_tokens: int = 4096,
) -> list[list[float]]:
    """Per-token logprobs of each completion given its prompt (at its sampling temperature),
    batched with left padding."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
    device = next(model.parameters()).device
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    result: list[list[float]] = [[] for _ in prompts]
    for indices in _batches(lengths, max_batch_tokens):
        batch = completion_batch(
            [prompts[i] for i in indices],
            [completions[i] for i in indices],
            None if temperatures is None else [temperatures[i] for i in indices],
        )
        logprobs = batch_logprobs(model, batch.to(device)).cpu()
        for row, i in enumerate(indices):
            n = len(completions[i])
            result[i] = logprobs[row, batch.width - n :].tolist() if n else []
    return result


def recompute_logprobs(
    model_dir: Path,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    adapter_dir: Path | None = None,
    device: torch.device | None = None,
    max_batch_tokens: int = 4096,
) -> list[list[float]]:
    """Load the policy (base model, optional LoRA) and recompute completion logprobs."""
    model = load_policy(model_dir, adapter_dir, device=device)
    return completion_logprobs(model, prompts, completions, max_batch_tokens=max_batch_tokens)


@dataclass(frozen=True)
class LogprobDrift:
    """How far recomputed logprobs are from the logged ones, over all tokens."""

    max_abs: float
    mean_abs: float
    tokens: int

    def within(self, tolerance: float) -> bool:
        """True when no token drifts more than `tolerance` (NaN never passes)."""
        return self.max_abs <= tolerance


def logprob_drift(
    logged: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]]
) -> LogprobDrift:
    """Max and mean |logged - recomputed| over every completion token."""
    if len(logged) != len(recomputed):
        raise ValueError(f"{len(logged)} logged sequences but {len(recomputed)} recomputed")
    max_abs, total, tokens = 0.0, 0.0, 0
    for index, (served, ours) in enumerate(zip(logged, recomputed, strict=True)):
        if len(served) != len(ours):
            raise ValueError(
                f"sequence {index}: {len(served)} logged logprobs but {len(ours)} recomputed"
            )
        for a, b in zip(served, ours, strict=True):
            delta = abs(a - b)
            if math.isnan(delta):
                return LogprobDrift(max_abs=math.nan, mean_abs=math.nan, tokens=tokens)
            max_abs = max(max_abs, delta)
            total += delta
            tokens += 1
    return LogprobDrift(max_abs=max_abs, mean_abs=total / tokens if tokens else 0.0, tokens=tokens)
