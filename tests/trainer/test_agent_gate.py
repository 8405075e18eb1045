"""Agent runs offline: each answer's calls run in the workspace as the simulated IDE runs
them, malformed ones counted, a run ending on an answer without a call; and the evaluation
gate built on them, which scores a policy that breaks its tool calls below its parent."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from app.agent_tasks import Workspace, agent_task
from app.tasks import train_tasks
from bench.agent_runs import load
from tests.conftest import fine_tune_toward_malformed_calls
from trainer.agent_runs import AgentRun, AgentTaskHeldOut, clean_solve_rate, take_turn


def a_run() -> AgentRun:
    task = agent_task(train_tasks(0, 1)[0], random.Random(0))
    return AgentRun(task, Workspace.for_task(task), [{"role": "user", "content": task.request}])


def call(name: str, **arguments: str) -> str:
    body = json.dumps({"name": name, "arguments": arguments})
    return f"<tool_call>\n{body}\n</tool_call>"


def test_a_read_and_a_fixing_edit_solve_the_run() -> None:
    run = a_run()
    task = run.task
    take_turn(run, call("read_file", path=task.path), 0)
    assert run.messages[-1] == {
        "role": "tool",
        "tool_call_id": "call_0_0",
        "content": task.starting_file,
    }
    take_turn(
        run,
        call(
            "edit_file", path=task.path, old_string=task.starting_body, new_string=task.fixed_body
        ),
        1,
    )
    take_turn(run, "Done.", 2)
    assert run.done and run.solved
    assert (run.calls, run.malformed, run.first_turn_question) == (2, 0, False)


def test_malformed_calls_are_counted_and_a_first_turn_question_ends_the_run() -> None:
    run = a_run()
    take_turn(run, call("write_file", path=run.task.path), 0)  # an unknown tool
    take_turn(run, '<tool_call>\n{"name": "read_file", "arguments": {"path": ', 1)  # cut off
    assert run.done and not run.solved
    assert (run.calls, run.malformed) == (2, 2)
    asking = a_run()
    take_turn(asking, "Which file should I change?", 0)
    assert asking.done and asking.first_turn_question and asking.calls == 0


def test_only_a_run_solved_without_a_malformed_call_counts_as_clean() -> None:
    solved, stumbled, failed = a_run(), a_run(), a_run()
    for run in (solved, stumbled):
        task = run.task
        if run is stumbled:
            take_turn(run, call("open_file", path=task.path), 0)
        take_turn(run, call("read_file", path=task.path), 1)
        take_turn(
            run,
            call(
                "edit_file",
                path=task.path,
                old_string=task.starting_body,
                new_string=task.fixed_body,
            ),
            2,
        )
    take_turn(failed, "Done.", 0)
    assert solved.solved and stumbled.solved and not failed.solved
    assert clean_solve_rate([solved, stumbled, failed]) == pytest.approx(1 / 3)
    assert clean_solve_rate([]) == 0.0


@pytest.mark.slow
def test_the_agent_gate_scores_a_candidate_that_breaks_its_tool_calls_below_its_parent(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Fine-tuned toward malformed calls, the candidate solves held-out runs cleanly about a
    # quarter as often as its parent (10.2% → 1.6% of 128, 9.4% → 2.7% of 256 measured).
    hacked = tmp_path / "hacked"
    fine_tune_toward_malformed_calls(tiny_model_dir, hacked)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    held_out = AgentTaskHeldOut(tasks=128)
    production = held_out.pass_rate(load(tiny_model_dir, None), tokenizer)
    candidate = held_out.pass_rate(load(tiny_model_dir, hacked), tokenizer)
    print(f"clean solves: production {production:.3f}, candidate {candidate:.3f}")
    assert candidate < production
    # Scored the same way again, the same policy gets the same rate: the gate's runs are
    # seeded, so production and candidate meet the same tasks in the same random stream.
    assert held_out.pass_rate(load(tiny_model_dir, hacked), tokenizer) == candidate
