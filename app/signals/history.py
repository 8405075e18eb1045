"""Evidence from the conversation itself: what became of a served answer, read from the next
request of its run.

Every coding agent re-sends the conversation on its next request: after the served answer
come the results of the answer's tool calls (each naming its call by `tool_call_id`), and
after a final answer the user's next message. Clients word what became of an edit in their
own fixed strings (recorded from the stock clients: `docs/ml-engineers/evidence.md`), so each
rule is a fact, a client's marker and what it means, not code per string. Only what the
client, its tools and the user wrote counts; the answer itself is read only for the ids of
its calls.

Verdicts:
  accepted      the client applied the edit ("has been updated successfully", ...)
  rejected      the user refused the call ("The user doesn't want to proceed ...", ...)
  unapplicable  the edit could not be applied ("String to replace not found in file", ...)
  interrupted   the user stopped the agent ("[Request interrupted by user]", ...)

Survival: when the file an earlier served edit applied is shown again (a read tool's result
in the next request), the share of the edit's inserted lines still in it (`survival`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from app.events import EditAccepted, EditRejected, EditSurvival, FollowupMessage
from app.signals.followup import is_dissatisfied
from app.signals.text import content_text
from app.signals.tools import call_arguments, is_edit_tool, is_read_tool

HistoryFeedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage

Verdict = Literal["accepted", "rejected", "unapplicable", "interrupted"]


@dataclass(frozen=True, slots=True)
class Rule:
    """A client's marker of what became of a call, found in a tool result (or, for an
    interrupt, in the user's message)."""

    client: str
    name: str
    verdict: Verdict
    marker: str
    """Text the client writes, matched as a substring, case and all."""

    @property
    def source(self) -> str:
        return f"history:{self.client}:{self.name}"


RULES: tuple[Rule, ...] = (
    # Refusals and failures before acceptances: a client's refusal text may quote the call.
    Rule("claude-code", "rejected", "rejected", "The user doesn't want to proceed with this tool"),
    Rule("claude-code", "not_granted", "rejected", "but you haven't granted it yet"),
    Rule("claude-code", "not_found", "unapplicable", "String to replace not found in file"),
    Rule("codex", "patch_rejected", "rejected", "patch rejected"),
    Rule("codex", "aborted", "interrupted", "aborted by user"),
    Rule("opencode", "rejected", "rejected", "The user rejected permission to use this"),
    Rule("qwen-code", "cancelled", "rejected", "[Operation Cancelled] Reason: User did not allow"),
    Rule("cline", "rejected", "rejected", "This tool call was rejected by the user"),
    Rule("continue", "denied", "rejected", "Permission denied by user"),
    Rule("claude-code", "updated", "accepted", "has been updated successfully"),
    Rule("codex", "updated", "accepted", "Success. Updated the following files"),
    Rule("opencode", "applied", "accepted", "Edit applied successfully"),
    Rule("qwen-code", "updated", "accepted", "has been updated. Showing lines"),
    Rule("cline", "edited", "accepted", '"result":"Edited '),
    Rule("continue", "edited", "accepted", "Successfully edited "),
)
"""Markers in the result of one of the answer's calls, first match wins (opencode's strings
are Kilo's too)."""

EDIT_ERROR = Rule("any", "edit_error", "unapplicable", "")
"""The fallback for a client whose words no rule knows: the result of an edit tool's call
(named as the gateway counts edits: `app.signals.tools`) that reports an error was not
applied. Read only where no rule matched."""

USER_RULES: tuple[Rule, ...] = (
    Rule("claude-code", "interrupted", "interrupted", "[Request interrupted by user"),
    Rule("codex", "turn_aborted", "interrupted", "<turn_aborted>"),
    Rule("aider", "no_match", "unapplicable", "SEARCH/REPLACE block failed to match"),
)
"""Markers in a user message after the answer."""


@dataclass(frozen=True, slots=True)
class Found:
    """One verdict on the served answer, and the rule that read it."""

    verdict: Verdict
    source: str
    call_id: str | None = None


@dataclass(slots=True)
class Evidence:
    """What the next request says of a served answer."""

    found: list[Found] = field(default_factory=list)
    followup: str | None = None
    """The user's next message after a final answer (one without tool calls)."""


def distill(answer: dict[str, Any], after: Sequence[dict[str, Any]]) -> Evidence:
    """The evidence on `answer` (the served answer as the client re-sent it) in the messages
    that follow it in the next request."""
    names = {
        call.get("id"): (call.get("function") or {}).get("name")
        for call in answer.get("tool_calls") or ()
        if isinstance(call, dict)
    }
    call_ids = set(names)
    evidence = Evidence()
    for message in after:
        role, text = message.get("role"), content_text(message.get("content"))
        if role == "tool" and message.get("tool_call_id") in call_ids:
            call_id = message["tool_call_id"]
            rule = _first(RULES, text)
            if rule is None and is_edit_tool(names[call_id]) and _is_error(text):
                rule = EDIT_ERROR
            if rule is not None:
                evidence.found.append(Found(rule.verdict, rule.source, call_id))
        elif role == "user":
            rule = _first(USER_RULES, text)
            if rule is not None:
                evidence.found.append(Found(rule.verdict, rule.source))
            elif not call_ids and evidence.followup is None and text.strip():
                evidence.followup = text
        elif role == "assistant":
            break  # the next answer: what follows it is evidence on that one
    return evidence


def _is_error(text: str) -> bool:
    """A tool result that reports a failure: it opens with "error" (any case, e.g. "Error:",
    "error:", "<tool_use_error>"), or is a JSON object with an "error" field."""
    head = text.lstrip()[:32].lower()
    return head.startswith(("error", "<tool_use_error>", '{"error"'))


def _first(rules: Sequence[Rule], text: str) -> Rule | None:
    return next((rule for rule in rules if rule.marker in text), None)


def feedback_of(
    evidence: Evidence, request_id: str, session_id: str, *, private: bool, at: datetime
) -> list[HistoryFeedback]:
    """The feedback events the evidence amounts to, on the served request `request_id`, as
    the workers read a client's: an applied edit is accepted, a refused or unapplicable one
    rejected, as is a call whose own result says the user aborted it (any acceptance wins, as
    for a multi-hunk edit), an interrupt is a dissatisfied
    follow-up, and the user's next message is the follow-up (classified here when the run is
    private: its text is not kept). Each names its rule in `source`."""
    ids: dict[str, Any] = {"request_id": request_id, "session_id": session_id}
    ids |= {"occurred_at": at, "received_at": at}
    events: list[HistoryFeedback] = []
    for verdicts, kind in (
        ({"accepted"}, EditAccepted),
        ({"rejected", "unapplicable", "interrupted"}, EditRejected),
    ):
        found = next(
            (
                f
                for f in evidence.found
                # An interrupt in a call's own result (Codex's "aborted by user" at the
                # approval prompt) means the call was not carried out: refused, as well.
                if f.verdict in verdicts and (f.verdict != "interrupted" or f.call_id)
            ),
            None,
        )
        if found is not None:
            events.append(kind(**ids, source=found.source))
    interrupt = next((f for f in evidence.found if f.verdict == "interrupted"), None)
    if interrupt is not None:
        events.append(FollowupMessage(**ids, dissatisfied=True, source=interrupt.source))
    elif evidence.followup is not None:
        text = evidence.followup[:16_000]
        said = {"dissatisfied": is_dissatisfied(text)} if private else {"message": text}
        events.append(FollowupMessage(**ids, **said, source="history:any:next_message"))
    return events


REREAD_SOURCE = "history:any:reread"
PATH_ARGUMENTS = ("file_path", "path", "filePath", "target_file", "filename", "file")
"""Where clients' edit and read tools name their file."""
INSERTED_ARGUMENTS = (
    "new_string",
    "newString",
    "new_str",
    "content",
    "file_text",
    "new_content",
    "replacement",
)
"""Where clients' edit tools carry the text they write (a whole file's, or a replacement's)."""
REPLACED_ARGUMENTS = ("old_string", "oldString", "old_str")
PARTIAL_READ_ARGUMENTS = (
    "offset",
    "limit",
    "start_line",
    "end_line",
    "view_range",
    "line_range",
    "lines",
)
"""A read that names a part of the file shows only that part: it is not read for survival."""
MAX_SURVIVAL_LINES = 256
"""Most inserted lines of one edit looked for: bounded work on a client's history."""
MAX_SHOWN_CHARS = 1_000_000
"""Most characters of one read result looked in."""
_LINE_NUMBER = re.compile(r"^\s*\d+\s*(?:→|\||:|\t)\s?")
"""A read tool's line-number prefix ("    12→", "00012| ", "12:", "12\t")."""


@dataclass(frozen=True, slots=True)
class Survived:
    """The share of a served edit's inserted lines found where the file was shown again."""

    request_id: str
    surviving_share: float
    source: str = REREAD_SOURCE


def survival(
    history: Sequence[dict[str, Any]],
    tail: Sequence[dict[str, Any]],
    request_of: Callable[[str], str | None],
) -> list[Survived]:
    """Survival of the edits served earlier in a run, from the files its next request shows.

    `history` ends with the served answer the request continues; `tail` is what follows it.
    Each read tool's result in `tail` (a call of that answer, by `tool_call_id`) that shows a
    whole file (no offset or line range) that an earlier served edit wrote (one whose call id
    names its request: `request_of`, and
    whose own result was not a refusal, a failure or an error) gives that edit the share of
    its inserted lines (those of its new text that its old text did not have, blank lines
    left out) found among the shown lines, line numbers stripped. Only client and tool text is
    read for the verdict; the answer's calls only name what was edited and read.
    """
    if not history:
        return []
    shown_by_call = {
        call_id: (name, call_arguments(raw)) for name, call_id, raw in _calls(history[-1])
    }
    reads: list[tuple[str, set[str]]] = []
    for message in tail:
        if message.get("role") != "tool" or message.get("tool_call_id") not in shown_by_call:
            continue
        name, arguments = shown_by_call[message["tool_call_id"]]
        path = _path(arguments)
        text = content_text(message.get("content"))[:MAX_SHOWN_CHARS]
        partial = any(arguments.get(key) not in (None, "") for key in PARTIAL_READ_ARGUMENTS)
        if path and is_read_tool(name) and not partial and not _is_error(text):
            reads.append((path, {_LINE_NUMBER.sub("", line).strip() for line in text.splitlines()}))
    if not reads:
        return []  # the common case: nothing shown, no edit looked at
    outcomes = {m.get("tool_call_id"): m for m in (*history, *tail) if m.get("role") == "tool"}
    found: dict[str, list[int]] = {}
    for message in history:
        for name, call_id, raw in _calls(message):
            request_id = request_of(call_id) if call_id else None
            outcome = outcomes.get(call_id)
            if request_id is None or outcome is None or not is_edit_tool(name):
                continue
            arguments = call_arguments(raw)
            edited = _path(arguments)
            shown_again = [shown for path, shown in reads if edited and _same_file(path, edited)]
            if not shown_again:
                continue
            inserted = _inserted_lines(arguments)
            if not inserted or not _applied(content_text(outcome.get("content"))):
                continue
            tally = found.setdefault(request_id, [0, 0])
            for shown in shown_again:
                tally[0] += len(inserted & shown)
                tally[1] += len(inserted)
    return [Survived(request_id, present / total) for request_id, (present, total) in found.items()]


def _calls(message: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """An answer's tool calls: (name, call id, arguments as sent)."""
    if message.get("role") != "assistant":
        return []
    return [
        (
            str((call.get("function") or {}).get("name") or ""),
            str(call.get("id") or ""),
            (call.get("function") or {}).get("arguments"),
        )
        for call in message.get("tool_calls") or ()
        if isinstance(call, dict)
    ]


def _path(arguments: dict[str, Any]) -> str:
    for name in PATH_ARGUMENTS:
        value = arguments.get(name)
        if isinstance(value, str) and value.strip():
            return value.strip().removeprefix("./")
    return ""


def _inserted_lines(arguments: dict[str, Any]) -> set[str]:
    new = next((v for k in INSERTED_ARGUMENTS if isinstance(v := arguments.get(k), str)), "")
    old = next((v for k in REPLACED_ARGUMENTS if isinstance(v := arguments.get(k), str)), "")
    kept = {line.strip() for line in old.splitlines()}
    inserted: set[str] = set()
    for line in new.splitlines():
        stripped = line.strip()
        if stripped and stripped not in kept:
            inserted.add(stripped)
            if len(inserted) == MAX_SURVIVAL_LINES:
                break
    return inserted


def _applied(result: str) -> bool:
    """Whether an edit call's result says it was carried out: no client's refusal or failure,
    and no error."""
    rule = _first(RULES, result)
    return (rule is None or rule.verdict == "accepted") and not _is_error(result)


def _same_file(shown: str, edited: str) -> bool:
    """The same file, named absolutely or relative to the workspace by either."""
    return shown == edited or shown.endswith("/" + edited) or edited.endswith("/" + shown)


def survival_feedback(
    survived: Sequence[Survived],
    accepted_at: Sequence[datetime | None],
    session_id: str,
    *,
    at: datetime,
) -> list[EditSurvival]:
    """Survival windows on the edits, each at the time since its acceptance (None: not known,
    no window)."""
    return [
        EditSurvival(
            request_id=found.request_id,
            session_id=session_id,
            elapsed_s=max((at - accepted).total_seconds(), 0.0),
            surviving_share=found.surviving_share,
            occurred_at=at,
            received_at=at,
            source=found.source,
        )
        for found, accepted in zip(survived, accepted_at, strict=True)
        if accepted is not None and accepted <= at
    ]
