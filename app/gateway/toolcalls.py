"""What a completion did: tool calls checked against the declared schemas, edits, questions."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from jsonschema.protocols import Validator

from app.gateway.schemas import ToolSpec
from app.signals.text import content_text
from app.signals.tools import is_edit_tool

# Tool names that write to the user's files, as IDE agents name them.
# `[ \t]`, not `\s`: `^\s*` would scan every newline after each line start (quadratic).
_CODE_FENCE = re.compile(r"^[ \t]*(```|~~~)", re.MULTILINE)
_EDIT_REQUEST = re.compile(
    r"\b(fix|change|refactor|rename|add|implement|write|update|edit|replace|remove|delete|"
    r"convert|rewrite|modify|move|extract|make it|make the|optimi[sz]e|port|migrate|create)\b",
    re.IGNORECASE,
)
_QUESTION_END = ("?", "？")


@dataclass(frozen=True, slots=True)
class ToolCallCheck:
    calls: int
    malformed: int
    edits: int
    """Well-formed calls whose tool name says it writes to files. A malformed one is not an
    edit: no client can run it, so none will report a verdict on it, and a reward that waited
    for one would never come (the call would escape its penalty)."""


class ToolSchemas:
    """The request's declared tools, with a compiled validator for each one's parameters."""

    def __init__(self, tools: Sequence[ToolSpec] | None) -> None:
        self._validators: dict[str, Validator | None] = {}
        for tool in tools or ():
            self._validators[tool.function.name] = tool.function.validator

    def check(self, tool_calls: Sequence[dict[str, Any]], text: str = "") -> ToolCallCheck:
        """Count the calls, the malformed ones (unknown tool, bad JSON, schema violation,
        or a call left in the text because the tool parser could not read it) and the
        edit-like ones."""
        unread = unread_tool_calls(text)
        malformed, edits = unread, 0
        for call in tool_calls:
            function = call.get("function") or {}
            name = function.get("name")
            if not self._valid(name, function.get("arguments")):
                malformed += 1
            elif is_edit_tool(name):
                edits += 1
        return ToolCallCheck(calls=len(tool_calls) + unread, malformed=malformed, edits=edits)

    def _valid(self, name: object, arguments: object) -> bool:
        if not isinstance(name, str) or name not in self._validators:
            return False
        try:
            parsed = orjson.loads(arguments) if isinstance(arguments, str | bytes) else arguments
        except orjson.JSONDecodeError:
            return False
        if not isinstance(parsed, dict):
            return False
        validator = self._validators[name]
        if validator is None:
            return True
        try:
            return bool(validator.is_valid(parsed))
        except RecursionError:  # arguments nested past what a validator can walk
            return False


# How the tool-call formats vLLM's parsers read open a call (hermes and Qwen, Mistral,
# Llama 3). A parser that reads a call removes it from the text; one it cannot read (broken
# JSON) is left there, and the client gets prose instead of a call.
_CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>")


def unread_tool_calls(text: str) -> int:
    """Tool calls the model wrote that the parser could not read: still in the text."""
    return sum(text.count(marker) for marker in _CALL_MARKERS)


def has_code_block(text: str) -> bool:
    """Whether the text contains a fenced code block."""
    return _CODE_FENCE.search(text) is not None


def proposes_edit(text: str, check: ToolCallCheck) -> bool:
    """A fenced code block or an edit-like tool call."""
    return check.edits > 0 or has_code_block(text)


def asks_clarifying_question(text: str, check: ToolCallCheck) -> bool:
    """No code and no tool calls, and the answer ends with a question."""
    return check.calls == 0 and not has_code_block(text) and text.rstrip().endswith(_QUESTION_END)


def looks_like_edit_request(messages: Sequence[dict[str, Any]]) -> bool:
    """Heuristic: the last user message uses a verb that asks for a change to code."""
    for message in reversed(messages):
        if message.get("role") == "user":
            return _EDIT_REQUEST.search(message_text(message)) is not None
    return False


def message_text(message: dict[str, Any]) -> str:
    """The text of a chat message, whether its content is a string or a list of parts."""
    return content_text(message.get("content"))
