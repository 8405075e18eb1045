"""The evaluation gate's held-out set for the bootstrapped model's task family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from app.serving.parity import CompletionBatch, completion_batch
from sandbox.agent_tasks import TOOLS, AgentTask, agent_tasks, reference_messages
from sandbox.tasks import Task, check_solution, extract_code, format_response, heldout_tasks
from trainer.config import TrainConfig
from trainer.evaluate import Reference
from trainer.generation import generate_answers, prompt_ids

EVAL_SEED = 20_261_129


@dataclass
class TaskFamilyHeldOut:
    """Held-out tasks of the family (unseen combinations of known skills), checked by running
    the answer's code; the reference answers are the tasks' own solutions, and the agent
    turns those of the agent tasks' reference runs."""

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

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> Reference:
        return Reference(
            answers=reference_batch(tokenizer, self._tasks),
            agent_turns=agent_reference_batch(tokenizer, self.tasks),
        )

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


def reference_turns(
    tokenizer: PreTrainedTokenizerFast, tasks: list[AgentTask]
) -> list[tuple[list[int], list[int]]]:
    """Each assistant turn of the tasks' reference runs (a read, an edit, the final answer) as
    prompt and answer token ids: the prompt with the tools declared, the answer as the chat
    template renders it, through its end token. A template that renders a past turn other
    than as the continuation of its prompt (one that drops reasoning, say) gives no turns."""
    tools: list[Any] = TOOLS
    turns = []
    for task in tasks:
        messages = reference_messages(task)
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = prompt_ids(tokenizer, messages[:index], tools)
            rendered = tokenizer.apply_chat_template(
                messages[: index + 1], tools=tools, tokenize=False
            )
            assert isinstance(rendered, str)
            whole = tokenizer.encode(rendered, add_special_tokens=False)
            if whole[: len(prompt)] == prompt and len(whole) > len(prompt):
                turns.append((prompt, whole[len(prompt) :]))
    return turns


def agent_reference_batch(tokenizer: PreTrainedTokenizerFast, tasks: int) -> CompletionBatch | None:
    """Held-out agent turns with their reference answers (tool calls, final answers), from
    `tasks` agent tasks: fixed text to measure how far a policy moved on the tokens agent
    traffic is made of; None when the chat template gives no such turns."""
    turns = reference_turns(tokenizer, agent_tasks(EVAL_SEED, tasks, "heldout"))
    if not turns:
        return None
    return completion_batch([prompt for prompt, _ in turns], [answer for _, answer in turns])
