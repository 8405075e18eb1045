"""The simulated IDE's reading of the model's tool calls: which it can run, which edit files.

The IDE knows its own tools (`sandbox.agent_tasks.TOOLS`). It runs a call to one of them whose
arguments are a JSON object matching the tool's declared schema, and answers any other call
with an error the model reads on its next turn. A call the model wrote into its text (the
server's tool parser could not read it) reaches the IDE as prose: it cannot run that either.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

from sandbox.agent_tasks import REQUIRED_ARGUMENTS, TOOLS, written_calls

EDIT_TOOLS = frozenset({"edit_file"})
"""The IDE's tools that change the developer's files (and so ask for their approval)."""

_VALIDATORS = {
    tool["function"]["name"]: Draft202012Validator(tool["function"]["parameters"]) for tool in TOOLS
}


@dataclass(frozen=True)
class IdeToolCall:
    """One tool call of a chat response, as the IDE read it."""

    call_id: str
    name: str
    arguments: str
    """The arguments exactly as the response carried them (JSON text)."""
    parsed: dict[str, Any] | None
    """The arguments as a JSON object; None when they are not one."""
    problem: str | None
    """Why the IDE cannot run the call; None when it can."""

    @property
    def runnable(self) -> bool:
        return self.problem is None

    @property
    def edits(self) -> bool:
        """A call to one of the IDE's editing tools, runnable or not."""
        return self.name in EDIT_TOOLS


def read_tool_call(call: Mapping[str, Any]) -> IdeToolCall:
    """A tool call in the OpenAI response shape, checked against the IDE's own tools."""
    function = call.get("function") or {}
    name = str(function.get("name") or "")
    arguments = function.get("arguments")
    text = arguments if isinstance(arguments, str) else ""
    parsed, problem = _check(name, text)
    return IdeToolCall(str(call.get("id") or ""), name, text, parsed, problem)


def unread_tool_calls(text: str) -> int:
    """Calls the model wrote into the text of its answer: the IDE got prose, not a call."""
    return len(written_calls(text))


def _check(name: str, arguments: str) -> tuple[dict[str, Any] | None, str | None]:
    validator = _VALIDATORS.get(name)
    if validator is None:
        return None, f"unknown tool {name!r}; the tools are {', '.join(sorted(_VALIDATORS))}"
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return None, "the arguments are not valid JSON"
    if not isinstance(parsed, dict):
        return None, "the arguments must be a JSON object"
    missing = [key for key in REQUIRED_ARGUMENTS[name] if not isinstance(parsed.get(key), str)]
    if missing:
        return parsed, f"missing required argument {missing[0]!r}"
    error = best_match(validator.iter_errors(parsed))
    if error is not None:
        return parsed, f"the arguments do not match the schema of {name}: {error.message}"
    return parsed, None
