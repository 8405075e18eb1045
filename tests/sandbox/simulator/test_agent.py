"""The simulated IDE runs the calls it can read in the task's workspace."""

from __future__ import annotations

import json
import random
from collections import Counter

from sandbox.agent_tasks import Workspace, agent_task
from sandbox.simulator.agent import RunTrace, execute, ideal_feedback
from sandbox.simulator.reactions import Reaction
from sandbox.simulator.toolcalls import read_tool_call
from sandbox.tasks import all_tasks

TASK = agent_task(all_tasks("train")[0], random.Random(0))


def a_call(name: str, arguments: str) -> dict[str, object]:
    return {
        "id": "call-0-r",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def test_an_edit_that_applies_succeeds_and_changes_the_file() -> None:
    workspace = Workspace.for_task(TASK)
    edit = {"path": TASK.path, "old_string": TASK.starting_body, "new_string": TASK.fixed_body}
    done = execute(workspace, TASK, "r", read_tool_call(a_call("edit_file", json.dumps(edit))))

    assert done.succeeded and done.output == "ok"
    assert workspace.edits == 1 and workspace.solves(TASK)


def test_an_edit_that_cannot_apply_runs_but_does_not_succeed() -> None:
    workspace = Workspace.for_task(TASK)
    edit = {"path": TASK.path, "old_string": "not in the file", "new_string": "pass"}
    done = execute(workspace, TASK, "r", read_tool_call(a_call("edit_file", json.dumps(edit))))

    assert not done.succeeded and done.output.startswith("error")
    assert workspace.edits == 0


def test_a_call_the_ide_cannot_run_is_answered_with_why_and_touches_nothing() -> None:
    workspace = Workspace.for_task(TASK)
    call = read_tool_call(a_call("edit_file", '{"path": "calc.py", "old_string": '))
    done = execute(workspace, TASK, "r", call)

    assert not done.succeeded
    assert done.output == "error: the arguments are not valid JSON"
    assert workspace.edits == 0 and workspace.files == {TASK.path: TASK.starting_file}


def test_reads_and_tests_succeed_when_they_run() -> None:
    workspace = Workspace.for_task(TASK)
    read = execute(
        workspace, TASK, "r", read_tool_call(a_call("read_file", json.dumps({"path": TASK.path})))
    )
    assert read.succeeded and read.output == TASK.starting_file
    missing = execute(workspace, TASK, "r", read_tool_call(a_call("read_file", '{"path": "x.py"}')))
    assert not missing.succeeded
    tests = execute(workspace, TASK, "r", read_tool_call(a_call("run_tests", "{}")))
    assert tests.succeeded and tests.output in ("passed", "failed")


def test_a_run_that_ends_on_an_edit_it_could_not_apply_reports_one_verdict_per_turn() -> None:
    # The gateway takes one edit_rejected per request (a second is a 409): the failed edit's
    # rejection is its verdict, and the developer's follow-up still lands on it.
    trace = RunTrace("s", turns=["s.0.0", "s.0.1"], not_applied=["s.0.0", "s.0.1"])
    reaction = Reaction(
        proposed_edit=True,
        accepted=False,
        survival=(),
        followup="that did not work",
        impatient=False,
        abandons_session=False,
    )

    events = ideal_feedback(trace, reaction)

    verdicts = Counter(e.request_id for e in events if e.kind in ("edit_accepted", "edit_rejected"))
    assert verdicts == {"s.0.0": 1, "s.0.1": 1}
    assert [e.request_id for e in events if e.kind == "followup_message"] == ["s.0.1"]
