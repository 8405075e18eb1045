"""Side requests: what a coding agent asks the model besides its agent turns (a title for the
conversation, a commit message, a summary to compact the history with, a guess of what the
user will type next, memories to keep). They are served as any request, and marked: they are
neither the user's follow-up to the turn before nor turns to train the agent on.

Each client words its side requests its own fixed way (recorded from the stock clients), so
each is a fact: the client, the kind, where the marker is and the marker itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.events import SideRequest
from app.signals.text import content_text


@dataclass(frozen=True, slots=True)
class Marker:
    client: str
    kind: SideRequest
    where: Literal["system", "last_user"]
    """The system messages, or the request's last user message."""
    text: str
    """Text the client writes, matched as a substring."""


MARKERS: tuple[Marker, ...] = (
    Marker("opencode", "title", "system", "You are a title generator"),
    Marker("codex", "title", "last_user", "Generate a concise, single-line task title"),
    Marker("continue", "title", "last_user", "reply with a title for the chat"),
    Marker("aider", "commit_message", "system", "one-line Git commit messages"),
    Marker("qwen-code", "suggestion", "last_user", "[SUGGESTION MODE:"),
    Marker("qwen-code", "memory", "system", "memory extraction"),
    Marker("claude-code", "summary", "last_user", "create a detailed summary of the conversation"),
)
"""opencode's title prompt is Kilo's too."""


def side_request(messages: Sequence[dict[str, Any]]) -> SideRequest | None:
    """What kind of side request these messages make, or None for an agent or chat turn."""
    system = "\n".join(
        content_text(m.get("content")) for m in messages if m.get("role") == "system"
    )
    last_user = next(
        (content_text(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), ""
    )
    texts = {"system": system, "last_user": last_user}
    return next((m.kind for m in MARKERS if m.text in texts[m.where]), None)
