"""The agentic task family: the workspace runs tool calls as an agent IDE would, and the
hidden checks judge the file the run leaves behind."""

import json
import random

from sandbox.agent_tasks import (
    STARTING_BODIES,
    TOOLS,
    Workspace,
    agent_task,
    agent_tasks,
    reference_messages,
    written_calls,
)
from sandbox.tasks import heldout_tasks, is_heldout, train_tasks


def test_the_reference_run_solves_the_task_and_a_wrong_edit_does_not() -> None:
    task = agent_tasks(3, 1, "train")[0]
    workspace = Workspace.for_task(task)
    assert not workspace.solves(task)
    for message in reference_messages(task):
        for call in message.get("tool_calls") or ():
            result, well_formed = workspace.run(
                task, call["function"]["name"], call["function"]["arguments"]
            )
            assert well_formed and not result.startswith("error")
    assert workspace.solves(task)
    assert workspace.read_before_edit and workspace.edits == 1

    wrong = Workspace.for_task(task)
    edit = {"path": task.path, "old_string": task.starting_body, "new_string": "return 12345"}
    assert wrong.run(task, "edit_file", json.dumps(edit)) == ("ok", True)
    assert not wrong.solves(task)
    assert wrong.read_before_edit is False
    assert wrong.run(task, "run_tests", "{}") == ("failed", True)


def test_malformed_calls_get_an_error_and_change_nothing() -> None:
    task = agent_tasks(4, 1, "train")[0]
    workspace = Workspace.for_task(task)
    before = dict(workspace.files)
    malformed = [
        ("write_file", json.dumps({"path": task.path})),
        ("edit_file", json.dumps({"path": task.path, "old_string": task.starting_body})),
        ("read_file", '{"path": "' + task.path),
        ("read_file", "[1, 2]"),
    ]
    for name, arguments in malformed:
        result, well_formed = workspace.run(task, name, arguments)
        assert result.startswith("error:") and not well_formed, (name, result)
    # Well formed, but not applicable: an error the agent can act on, not a malformed call.
    result, well_formed = workspace.run(
        task,
        "edit_file",
        json.dumps({"path": task.path, "old_string": "no such text", "new_string": "x"}),
    )
    assert well_formed and "exactly once" in result
    assert workspace.files == before and workspace.edits == 0


def test_calls_written_in_raw_text_are_read_in_order_and_unreadable_ones_are_marked() -> None:
    task = agent_tasks(6, 1, "train")[0]
    arguments = json.dumps({"path": task.path})
    read = f'<tool_call>\n{{"name": "read_file", "arguments": {arguments}}}\n</tool_call>'
    unreadable = '<tool_call>\n{"name": "run_tests"}\n</tool_call>'  # no arguments
    calls = written_calls(f"{read}\n{unreadable}")
    assert calls[1] is None
    assert calls[0] is not None and calls[0]["name"] == "read_file"
    result, well_formed = Workspace.for_task(task).run(task, **calls[0])
    assert well_formed and result == Workspace.for_task(task).files[task.path]

    cut_off = '<tool_call>\n{"name": "read_file", "arguments": {"path": '
    assert written_calls(cut_off) == [None]
    assert written_calls("Which file should I change?") == []


def test_tasks_keep_the_family_split_and_every_starting_body_occurs() -> None:
    train = agent_tasks(5, 200, "train")
    heldout = agent_tasks(5, 50, "heldout")
    assert all(not is_heldout(t.task.operation, t.task.constant) for t in train)
    assert all(is_heldout(t.task.operation, t.task.constant) for t in heldout)
    assert {t.starting_body for t in train} == set(STARTING_BODIES)
    assert {t.task.task_id for t in heldout} <= {t.task_id for t in heldout_tasks(5, 50)}
    assert len({t.task_id for t in train}) > 150
    # Each request names the file, in the developer's language.
    zh = agent_task(next(t for t in train_tasks(6, 50) if t.language == "zh"), random.Random(0))
    assert zh.path in zh.request and "函数在" in zh.request
    assert {tool["function"]["name"] for tool in TOOLS} == {"read_file", "edit_file", "run_tests"}
