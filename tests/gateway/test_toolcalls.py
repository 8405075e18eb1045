"""What a completion did: tool calls checked against their schemas, edits, questions."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import ValidationError

from app.gateway.schemas import CHECKED_SCHEMA_BYTES, ChatRequest, ToolSpec
from app.gateway.toolcalls import (
    ToolSchemas,
    asks_clarifying_question,
    looks_like_edit_request,
    proposes_edit,
)
from app.signals.tools import is_edit_tool

TOOLS = [
    ToolSpec.model_validate(
        {
            "type": "function",
            "function": {
                "name": "edit_file",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                    "required": ["path"],
                    "additionalProperties": False,
                },
            },
        }
    ),
    ToolSpec.model_validate({"type": "function", "function": {"name": "search_docs"}}),
]


def call(name: str, arguments: str) -> dict[str, object]:
    return {"id": "c", "type": "function", "function": {"name": name, "arguments": arguments}}


@pytest.mark.parametrize(
    ("tool_call", "malformed"),
    [
        (call("edit_file", '{"path": "a.py", "line": 3}'), False),
        (call("search_docs", '{"query": "anything goes"}'), False),
        (call("edit_file", '{"line": 3}'), True),
        (call("edit_file", '{"path": "a.py", "line": "three"}'), True),
        (call("edit_file", '{"path": "a.py", "mode": "w"}'), True),
        (call("edit_file", '{"path": "a.py"'), True),
        (call("edit_file", '["a.py"]'), True),
        (call("delete_everything", "{}"), True),
    ],
)
def test_tool_calls_are_checked_against_the_declared_schema(
    tool_call: dict[str, object], malformed: bool
) -> None:
    check = ToolSchemas(TOOLS).check([tool_call])
    assert (check.calls, check.malformed) == (1, int(malformed))


def test_edits_and_clarifying_questions() -> None:
    schemas = ToolSchemas(TOOLS)
    nothing = schemas.check([])
    edit_call = schemas.check([call("edit_file", '{"path": "a.py"}')])
    search_call = schemas.check([call("search_docs", "{}")])

    assert proposes_edit("Here:\n```python\nreturn x + 3\n```", nothing)
    assert proposes_edit("", edit_call)
    # A broken edit call proposes nothing: no IDE can apply it, so none reports a verdict.
    broken = schemas.check([call("edit_file", '{"path": "a.py"')])
    assert (broken.malformed, broken.edits) == (1, 0) and not proposes_edit("", broken)
    mixed = schemas.check([call("edit_file", '{"line": 3}'), call("edit_file", '{"path": "a"}')])
    assert (mixed.malformed, mixed.edits) == (1, 1) and proposes_edit("", mixed)
    assert not proposes_edit("Use `x + 3`.", search_call)
    assert asks_clarifying_question("Which file do you mean?", nothing)
    assert not asks_clarifying_question("```py\nx?\n```\nLike this?", nothing)
    assert not asks_clarifying_question("Which file?", search_call)
    assert not asks_clarifying_question("Done.", nothing)


def test_the_edit_tools_of_stock_agents_are_edits_and_their_reads_are_not() -> None:
    edits = (
        "edit_existing_file",
        "create_new_file",
        "single_find_and_replace",
        "write_to_file",
        "apply_diff",
        "replace_in_file",
        "insert_content",
        "edit_file",
    )
    reads = ("read_file", "ls", "grep_search", "run_terminal_command", "search_files")
    assert all(is_edit_tool(name) for name in edits)
    assert not any(is_edit_tool(name) for name in reads)


def test_edit_requests_are_guessed_from_the_last_user_message() -> None:
    assert looks_like_edit_request([{"role": "user", "content": "Please fix the bug in f"}])
    assert looks_like_edit_request(
        [{"role": "user", "content": [{"type": "text", "text": "rename x to y"}]}]
    )
    assert not looks_like_edit_request(
        [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "done"},
            {"role": "user", "content": "what does this function do?"},
        ]
    )


@pytest.mark.timeout(10)
def test_an_answer_of_blank_lines_is_read_in_linear_time() -> None:
    # What the model writes is as long as max_tokens allows: 16,000 newlines took 2 s when the
    # fence rule's `^\s*` ran over every newline after each line start.
    nothing = ToolSchemas(TOOLS).check([])
    blank = "\n" * 16_000
    assert not proposes_edit(blank, nothing)
    assert proposes_edit(blank + "    ```python\nreturn x\n```", nothing)
    assert not asks_clarifying_question(blank, nothing)
    assert not looks_like_edit_request([{"role": "user", "content": blank}])


def declaring(schema: dict[str, Any], name: str = "edit_file") -> ChatRequest:
    """A request declaring one tool with `schema`, parsed as the gateway parses each one."""
    return ChatRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "fix a.py"}],
            "tools": [{"type": "function", "function": {"name": name, "parameters": schema}}],
        }
    )


def test_a_schema_declared_on_every_turn_gets_the_same_verdict_every_time() -> None:
    # An agent re-declares its tools on every turn: each schema is judged once and kept, by
    # what it says (not the tool's name), and a kept verdict is the verdict.
    strict = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    loose = {"type": "object", "properties": {"path": {"type": "integer"}}}
    broken = {"type": "object", "properties": {"path": {"type": 3}}}
    for _ in range(3):
        schemas = ToolSchemas(declaring(strict).tools)
        assert schemas.check([call("edit_file", '{"path": "a.py"}')]).malformed == 0
        assert schemas.check([call("edit_file", '{"line": 3}')]).malformed == 1
        other = ToolSchemas(declaring(loose).tools)  # same name, another schema
        assert other.check([call("edit_file", '{"path": 3}')]).malformed == 0
        assert other.check([call("edit_file", '{"path": "a.py"}')]).malformed == 1
        with pytest.raises(ValidationError, match="not a valid JSON Schema"):
            declaring(broken)


def test_a_schema_too_large_to_keep_is_still_judged_and_used() -> None:
    fields = {f"field_{n}": {"type": "string", "description": "x" * 40} for n in range(400)}
    large = {"type": "object", "properties": fields, "required": ["field_7"]}
    assert len(orjson.dumps(large)) > CHECKED_SCHEMA_BYTES
    schemas = ToolSchemas(declaring(large).tools)
    assert schemas.check([call("edit_file", '{"field_7": "a"}')]).malformed == 0
    assert schemas.check([call("edit_file", '{"field_8": "a"}')]).malformed == 1
    with pytest.raises(ValidationError, match="not a valid JSON Schema"):
        declaring(large | {"required": "field_7"})


@pytest.mark.timeout(10)
def test_a_client_pattern_never_runs_on_what_the_model_wrote() -> None:
    # Python's `re` takes 0.5 s for `^(\w+\s?)*$` against 22 word characters and one that does
    # not match, three times longer for every two more: a path of 40 would never return, and
    # the gateway's event loop (its /healthz too) with it.
    schema = {
        "type": "object",
        "properties": {"path": {"type": "string", "pattern": r"^(\w+\s?)*$"}},
        "patternProperties": {r"^(a+)+$": {"type": "integer"}},
        "additionalProperties": False,
        "required": ["path"],
    }
    tools = ToolSchemas(declaring(schema).tools)
    hostile = orjson.dumps({"path": "a" * 40 + "!", "a" * 40 + "!": 1}).decode()
    assert tools.check([call("edit_file", hostile)]).malformed == 0
    # What the schema says besides its patterns is still checked.
    assert tools.check([call("edit_file", '{"line": 3}')]).malformed == 1
    assert tools.check([call("edit_file", '{"path": 3}')]).malformed == 1
