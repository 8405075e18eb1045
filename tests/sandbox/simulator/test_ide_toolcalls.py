"""The simulated IDE reads the model's tool calls with its own tools' schemas."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sandbox.simulator.toolcalls import read_tool_call, unread_tool_calls


def a_call(name: str, arguments: str, call_id: str = "call-0-r1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_a_call_matching_its_tool_is_runnable_and_an_edit_call_is_an_edit() -> None:
    arguments = json.dumps({"path": "calc.py", "old_string": "return x", "new_string": "pass"})
    call = read_tool_call(a_call("edit_file", arguments))

    assert call.runnable and call.edits
    assert call.call_id == "call-0-r1"
    assert call.arguments == arguments
    assert call.parsed == {"path": "calc.py", "old_string": "return x", "new_string": "pass"}
    read = read_tool_call(a_call("read_file", '{"path": "calc.py"}'))
    assert read.runnable and not read.edits
    assert read_tool_call(a_call("run_tests", "")).runnable


@pytest.mark.parametrize(
    ("name", "arguments", "problem"),
    [
        ("write_file", '{"path": "calc.py"}', "unknown tool 'write_file'"),
        ("read_file", '{"path": "calc.py"', "not valid JSON"),
        ("read_file", '["calc.py"]', "must be a JSON object"),
        ("edit_file", '{"path": "calc.py", "old_string": "x"}', "missing required argument"),
        ("read_file", '{"path": 3}', "missing required argument 'path'"),
        ("read_file", '{"path": "calc.py", "lines": 3}', "do not match the schema of read_file"),
    ],
)
def test_a_call_the_ide_cannot_run_says_why(name: str, arguments: str, problem: str) -> None:
    call = read_tool_call(a_call(name, arguments))
    assert not call.runnable
    assert call.problem is not None and problem in call.problem


def test_an_edit_call_the_ide_cannot_run_is_still_a_call_to_an_editing_tool() -> None:
    call = read_tool_call(a_call("edit_file", "{not json"))
    assert call.edits and not call.runnable and call.parsed is None


def test_calls_left_in_the_text_are_counted_as_calls_the_ide_never_got() -> None:
    assert unread_tool_calls("Sure, here is the fix.") == 0
    written = '<tool_call>{"name": "read_file", "arguments": {"path": "calc.py"}}</tool_call>'
    assert unread_tool_calls(written + " and " + written) == 2
    assert unread_tool_calls('<tool_call>{"name": "read_file", "argu') == 1
