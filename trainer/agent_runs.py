"""Agent runs of a policy offline, as `rtrl simulate --agent` makes them through the stack,
and the evaluation gate's held-out set built on them.

Each run is an agent task's workspace with the tools declared: every call the policy writes
is executed in the workspace and its result sent back, for at most `MAX_TURNS` turns, and
the file it leaves is judged by the task's hidden checks. Answers are sampled at
temperature 1, as vLLM serves them, so a habit the policy has a fair chance of (a malformed
call, a needless question) shows as often as in production.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from app.agent_tasks import MAX_TURNS, TOOLS, AgentTask, Workspace, agent_tasks, written_calls
from app.serving.parity import CompletionBatch
from app.tasks import heldout_tasks
from trainer.config import TrainConfig
from trainer.generation import generate_answers
from trainer.task_family import EVAL_SEED, reference_batch


@dataclass
class AgentRun:
    task: AgentTask
    workspace: Workspace
    messages: list[dict[str, Any]]
    calls: int = 0
    malformed: int = 0
    first_turn_question: bool = False
    done: bool = False

    @property
    def solved(self) -> bool:
        return self.workspace.solves(self.task)


@torch.no_grad()
def run_agents(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    tasks: list[AgentTask],
    *,
    seed: int,
    max_new_tokens: int = 96,
    batch_size: int = 32,
) -> list[AgentRun]:
    """One agent run per task, every live run's next turn generated in batches; the caller's
    random state is left as it was."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _run_agents(model, tokenizer, tasks, max_new_tokens, batch_size)


def _run_agents(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    tasks: list[AgentTask],
    max_new_tokens: int,
    batch_size: int,
) -> list[AgentRun]:
    model.eval()
    runs = [
        AgentRun(task, Workspace.for_task(task), [{"role": "user", "content": task.request}])
        for task in tasks
    ]
    for turn in range(MAX_TURNS):
        live = [run for run in runs if not run.done]
        if not live:
            break
        answers = generate_answers(
            model,
            tokenizer,
            [run.messages for run in live],
            sample=True,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            tools=TOOLS,
        )
        for run, answer in zip(live, answers, strict=True):
            take_turn(run, answer, turn)
    return runs


def take_turn(run: AgentRun, answer: str, turn: int) -> None:
    """Execute the answer's calls in the run's workspace, as the simulated IDE does."""
    calls = []
    for number, call in enumerate(written_calls(answer)):
        if call is None:
            run.calls += 1
            run.malformed += 1
            continue
        calls.append({"id": f"call_{turn}_{number}", **call})
    if not calls:
        run.first_turn_question = turn == 0 and answer.rstrip().endswith(("?", "？"))
        run.messages.append({"role": "assistant", "content": answer})
        run.done = True
        return
    run.messages.append(
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
                for call in calls
            ],
        }
    )
    for call in calls:
        result, well_formed = run.workspace.run(run.task, call["name"], call["arguments"])
        run.calls += 1
        run.malformed += not well_formed
        run.messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})


def clean_solve_rate(runs: list[AgentRun]) -> float:
    """Share of runs that solved their task with every tool call well formed."""
    return sum(run.solved and not run.malformed for run in runs) / len(runs) if runs else 0.0


@dataclass
class AgentTaskHeldOut:
    """Held-out agent tasks, each run offline to the end: a policy passes a task when its
    run solves it without one malformed call. A candidate that breaks its tool calls (one
    agent cycle once turned 23% of the calls into an unknown `edit_` tool) falls here, where
    the one-turn task family's gate saw its code answers improve.

    Runs are sampled with one fixed seed, so production and candidate meet the same tasks
    in the same random stream. How far a policy moved is measured on the task family's
    reference answers, as in that gate."""

    tasks: int
    """How many held-out agent tasks (one run each)."""

    def __post_init__(self) -> None:
        self._tasks = agent_tasks(EVAL_SEED, self.tasks, "heldout")

    @property
    def name(self) -> str:
        return "agent_tasks"

    @property
    def withheld_percent(self) -> int:
        return 0  # the tasks are generated, never served

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> CompletionBatch:
        return reference_batch(tokenizer, heldout_tasks(EVAL_SEED, self.tasks))

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        return clean_solve_rate(run_agents(model, tokenizer, self._tasks, seed=EVAL_SEED))


def agent_task_held_out(config: TrainConfig) -> AgentTaskHeldOut:
    """The agent tasks' held-out set, sized by the trainer's evaluation settings."""
    return AgentTaskHeldOut(tasks=config.eval_tasks)
