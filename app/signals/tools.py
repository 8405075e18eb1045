"""What a tool's name says it does, read from the names clients give their tools."""

from __future__ import annotations

import re
from typing import Any

import orjson

_EDIT_TOOL = re.compile(
    r"(edit|write|patch|replace|insert|apply|create_file|new_file|update_file|modify|rename|"
    r"delete_file)",
    re.IGNORECASE,
)


def is_edit_tool(name: object) -> bool:
    """Whether a tool's name says it writes to the user's files."""
    return _EDIT_TOOL.search(str(name or "")) is not None


_READ_TOOL = re.compile(r"(read|view|open|cat|show|get_file|file_content)", re.IGNORECASE)


def is_read_tool(name: object) -> bool:
    """Whether a tool's name says it shows a file's contents (and does not write them)."""
    text = str(name or "")
    return _READ_TOOL.search(text) is not None and not is_edit_tool(text)


def call_arguments(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as an object: parsed when JSON text, `{}` when not an object
    (clients re-send a call they could not parse with `{}`)."""
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return {}
    return arguments if isinstance(arguments, dict) else {}
