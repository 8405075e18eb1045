"""How stock coding agents word what became of an edit, for the simulator to play them.

Each rendering is what one client writes in the tool result of an edit call (applied,
refused by the user at the permission prompt, failed to apply) and in the user message after
a refusal, as recorded from the stock clients (`docs/ml-engineers/evidence.md` lists the
recordings). They are the simulator's own copies, written out in full as the clients send
them: the gateway's reader (`app.signals.history`) matches markers of its own, so the
simulator's ground truth measures the reader instead of repeating it.

The simulated clients all speak Chat Completions: the wire of each surface (Messages for
Claude Code, Responses for Codex) is the gateway's tests' business; here it is the words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

RenderedClient = Literal["claude-code", "codex", "opencode", "cline"]
RENDERED_CLIENTS: tuple[RenderedClient, ...] = get_args(RenderedClient)
REPO = "/home/dev/project"
"""Where the simulated developer's repository is checked out (clients name absolute paths)."""


@dataclass(frozen=True)
class Rendering:
    """One client's words; `{path}` is the file's absolute path, `{name}` its name."""

    session_header: str | None
    """The header that carries the client's session id (None: it sends none)."""
    applied: str
    refused: str
    """Names no file: written as is."""
    unapplicable: str | None
    """The result of an approved edit the file refused; None: the client passes the tool's
    own error through."""
    after_refusal: str | None
    """A user message the client adds after a refusal, before the user's words."""


RENDERINGS: dict[RenderedClient, Rendering] = {
    "claude-code": Rendering(
        session_header="X-Claude-Code-Session-Id",
        applied="The file {path} has been updated successfully. (file state is current in your"
        " context — no need to Read it back)",
        refused="The user doesn't want to proceed with this tool use. The tool use was rejected"
        " (eg. if it was a file edit, the new_string was NOT written to the file). STOP what"
        " you are doing and wait for the user to tell you how to proceed.",
        unapplicable="<tool_use_error>String to replace not found in file.\nString: {old}"
        "</tool_use_error>",
        after_refusal="[Request interrupted by user for tool use]",
    ),
    "codex": Rendering(
        session_header="session-id",
        applied="Wall time: 0.0000 seconds\nOutput:\nExit code: 0\nWall time: 0.1 seconds\n"
        "Output:\nSuccess. Updated the following files:\nM {name}\n",
        refused="Wall time: 11.6 seconds\naborted by user",
        unapplicable=None,
        after_refusal="<turn_aborted>\nThe user interrupted the previous turn on purpose.",
    ),
    "opencode": Rendering(
        session_header="x-session-id",
        applied="Edit applied successfully.",
        refused="The user rejected permission to use this specific tool call.",
        unapplicable=None,
        after_refusal=None,
    ),
    "cline": Rendering(
        session_header=None,
        applied='{{"query":"edit:{path}","result":"Edited {path}\\n```diff\\n(the change)\\n```",'
        '"success":true}}',
        refused='{"error":"This tool call was rejected by the user and not executed. -- NOT a'
        ' tool or system failure. Clarify with user before proceeding."}',
        unapplicable=None,
        after_refusal=None,
    ),
}


def rendered_result(
    client: RenderedClient,
    outcome: Literal["applied", "refused", "unapplicable"],
    *,
    path: str,
    old: str,
    tool_output: str,
) -> str:
    """The tool result `client` sends back for an edit of `path` with this outcome."""
    rendering = RENDERINGS[client]
    if outcome == "refused":
        return rendering.refused  # names no file
    fields = {"path": f"{REPO}/{path}", "name": path, "old": old}
    if outcome == "applied":
        return rendering.applied.format(**fields)
    if rendering.unapplicable is None:
        return tool_output
    return rendering.unapplicable.format(**fields)
