"""Agent runs of a policy offline, as `rtrl simulate --agent` makes them through the stack,
and the evaluation gate's held-out set built on them.

Each run is an agent task's workspace with the tools declared: every call the policy writes
is executed in the workspace and its result sent back, for at most `MAX_TURNS` turns, and
the file it leaves is judged by the task's hidden checks. Answers are sampled at
temperature 1, as vLLM serves them, so a habit the policy has a fair chance of (a malformed
call, a needless question) shows as often as in production.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from app.abtest.stats import Comparison, compare_ratios, user_ratio
from sandbox.agent_tasks import MAX_TURNS, TOOLS, AgentTask, Workspace, agent_tasks, written_calls
from sandbox.task_family import EVAL_SEED, agent_reference_batch, reference_batch
from sandbox.tasks import heldout_tasks
from trainer.config import TrainConfig
from trainer.evaluate import Reference
from trainer.generation import generate_answers


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


RUN_METRICS: dict[str, Callable[[AgentRun], tuple[float, float]]] = {
    # Runs whose final file passes the hidden checks, of all runs.
    "solved": lambda run: (float(run.solved), 1.0),
    # Malformed calls (unreadable, an unknown tool, a missing argument), of all calls.
    "malformed": lambda run: (float(run.malformed), float(run.calls)),
    # Runs whose first answer was a question, of all runs.
    "questions": lambda run: (float(run.first_turn_question), 1.0),
}
"""metric -> (numerator, denominator) of one run."""


def compare_over_runs(
    ours: Sequence[tuple[float, float]], theirs: Sequence[tuple[float, float]]
) -> Comparison | None:
    """Our ratio of sums minus theirs, with its 95% interval over runs: the delta method the
    A/B results use over users, with each run as the unit. A run's calls are not independent
    of each other (a model that breaks one call often breaks the next), so a share of calls
    is judged by how much it varies between runs, not as if every call were a coin flip.
    None when either side has under two runs or no denominator."""
    mine, other = user_ratio(ours), user_ratio(theirs)
    if mine is None or other is None:
        return None
    return compare_ratios(mine, other)


def compare_runs(ours: list[AgentRun], theirs: list[AgentRun], metric: str) -> Comparison | None:
    """`metric` (a `RUN_METRICS` name) of our runs minus theirs, with its 95% interval."""
    of_run = RUN_METRICS[metric]
    return compare_over_runs([of_run(run) for run in ours], [of_run(run) for run in theirs])


@dataclass
class PolicyRuns:
    """One policy's runs on a set of tasks, under a name for tables."""

    name: str
    runs: list[AgentRun] = field(default_factory=list)

    def rate(self, metric: str) -> tuple[float, int]:
        """`metric`'s ratio of sums over the runs, and its denominator (runs or calls)."""
        pairs = [RUN_METRICS[metric](run) for run in self.runs]
        numerator, denominator = sum(y for y, _ in pairs), sum(n for _, n in pairs)
        return (numerator / denominator if denominator else 0.0), int(denominator)


def runs_table(results: list[PolicyRuns]) -> str:
    """Solved runs, malformed calls and first-turn questions per policy, each against the
    first with its 95% interval over runs, then solved runs per operation."""
    metrics = (
        ("solved runs", "solved", "runs"),
        ("malformed calls", "malformed", "calls"),
        ("first-turn questions", "questions", "runs"),
    )
    lines = [f"{'checkpoint':<28}" + "".join(f"{label:<40}" for label, _, _ in metrics)]
    reference = results[0]
    for result in results:
        cells = []
        for _, metric, unit in metrics:
            value, count = result.rate(metric)
            cell = f"{value * 100:.1f}% of {count} {unit}"
            versus = None
            if result is not reference:
                versus = compare_runs(result.runs, reference.runs, metric)
            if versus is not None:
                cell += f" ({versus.difference * 100:+.1f}"
                if versus.ci_low is not None and versus.ci_high is not None:
                    cell += f" [{versus.ci_low * 100:+.1f}, {versus.ci_high * 100:+.1f}]"
                cell += ")"
            cells.append(f"{cell:<40}")
        lines.append(f"{result.name:<28}" + "".join(cells))
    lines.append(
        "95% intervals over runs (each run one unit, calls included), against the first row"
    )
    for result in results:
        by_operation: dict[str, list[bool]] = defaultdict(list)
        for run in result.runs:
            by_operation[run.task.task.operation].append(run.solved)
        shares = ", ".join(
            f"{name} {sum(v) / len(v):.0%}" for name, v in sorted(by_operation.items())
        )
        lines.append(f"{result.name}: solved by operation: {shares}")
    return "\n".join(lines)


def load_policy(model_dir: Path, adapter: Path | None = None) -> torch.nn.Module:
    """The base model, with a checkpoint's adapter merged in when given, for sampling runs."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


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
    reference answers and agent turns, as in that gate."""

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

    def reference(self, tokenizer: PreTrainedTokenizerFast) -> Reference:
        return Reference(
            answers=reference_batch(tokenizer, heldout_tasks(EVAL_SEED, self.tasks)),
            agent_turns=agent_reference_batch(tokenizer, self.tasks),
        )

    def pass_rate(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerFast) -> float:
        return clean_solve_rate(run_agents(model, tokenizer, self._tasks, seed=EVAL_SEED))


def agent_task_held_out(config: TrainConfig) -> AgentTaskHeldOut:
    """The agent tasks' held-out set, sized by the trainer's evaluation settings."""
    return AgentTaskHeldOut(tasks=config.eval_tasks)
