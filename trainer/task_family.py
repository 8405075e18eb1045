"""The evaluation gate's held-out set for the bootstrapped model's task family."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast

from app.serving.parity import CompletionBatch, completion_batch
from app.tasks import Task, check_solution, extract_code, format_response, heldout_tasks
from trainer.config import TrainConfig
from trainer.generation import generate_answers, prompt_ids

EVAL_SEED = 20_261_129


@dataclass
class TaskFamilyHeldOut:
    """Held-out tasks of the family (unseen combinations of known skills), checked by running
    the answer's code; the reference answers are the tasks' own solutions."""

    tasks: int
    """How many held-out tasks."""
    max_new_tokens: int
    """Generation length of each answer."""

    def __post_init__(self) -> None:
        self._tasks = heldout_tasks(EVAL_SEED, self.tasks)

    @property
    def name(self) -> str:
        return "task_family"

    @property
    def withheld_percent(self) -> int:
        return 0  # the tasks are generated, never served

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> CompletionBatch:
        return reference_batch(tokenizer, self._tasks)

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        return heldout_pass_rate(model, tokenizer, self._tasks, max_new_tokens=self.max_new_tokens)


def task_family_held_out(config: TrainConfig) -> TaskFamilyHeldOut:
    """The task family's held-out set, sized by the trainer's evaluation settings."""
    return TaskFamilyHeldOut(tasks=config.eval_tasks, max_new_tokens=config.eval_max_new_tokens)


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
        model,
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
