"""The text of a chat message's content."""

from __future__ import annotations

from typing import Any


def content_text(content: Any) -> str:
    """The text of a message's content, whether a string or a list of parts (text parts joined
    by newlines; other parts have none)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, dict) and part.get("type") == "text"
        )
    return ""
