"""bench.agent_runs' IDE side: each answer's calls run in the workspace as the simulator runs
them, malformed ones counted, and a run ends on an answer without a call."""

from __future__ import annotations

import json
import random

import pytest

from app.agent_tasks import Workspace, agent_task
from app.tasks import train_tasks
from bench.agent_runs import Result, Run, difference, take_turn


def a_run() -> Run:
    task = agent_task(train_tasks(0, 1)[0], random.Random(0))
    return Run(task, Workspace.for_task(task), [{"role": "user", "content": task.request}])


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


def test_the_difference_of_two_shares_has_a_95_percent_interval_around_it() -> None:
    gap, low, high = difference((0.6, 600), (0.5, 600))
    standard_error = (0.6 * 0.4 / 600 + 0.5 * 0.5 / 600) ** 0.5
    assert gap == pytest.approx(0.1)
    assert (low, high) == pytest.approx(
        (0.1 - 1.96 * standard_error, 0.1 + 1.96 * standard_error), abs=1e-4
    )
    assert Result("empty").solved == (0.0, 0)
