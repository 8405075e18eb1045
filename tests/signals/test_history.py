"""The clients' own words, as recorded from the stock clients, read
as what became of the served answer."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import pytest

from app.signals.history import distill, feedback_of, survival, survival_feedback

T0 = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)
CLAUDE_REFUSED = "The user doesn't want to proceed with this tool use. The tool use was rejected"

ANSWER = {
    "role": "assistant",
    "content": "",
    "tool_calls": [
        {"id": "call-0-r1", "type": "function", "function": {"name": "edit", "arguments": "{}"}}
    ],
}


def result(text: str, call_id: str = "call-0-r1") -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id, "content": text}


@pytest.mark.parametrize(
    ("client", "text", "verdict"),
    [
        (
            "claude-code",
            "The file /repo/calc.py has been updated successfully. (file state is current in "
            "your context — no need to Read it back)",
            "accepted",
        ),
        (
            "claude-code",
            "Claude requested permissions to write to /repo/calc.py, but you haven't granted "
            "it yet.",
            "rejected",
        ),
        ("claude-code", "Error: String to replace not found in file.", "unapplicable"),
        (
            "codex",
            "Wall time: 0.0000 seconds\nOutput:\nExit code: 0\nWall time: 0.1 seconds\nOutput:\n"
            "Success. Updated the following files:\nM calc.py\n",
            "accepted",
        ),
        (
            "codex",
            "patch rejected: writing is blocked by read-only sandbox; rejected by user approval "
            "settings",
            "rejected",
        ),
        ("codex", "Wall time: 11.6 seconds\naborted by user", "interrupted"),
        ("opencode", "Edit applied successfully.", "accepted"),
        ("opencode", "The user rejected permission to use this specific tool call.", "rejected"),
        (
            "qwen-code",
            "The file: /repo/calc.py has been updated. Showing lines 1-6 of 7 from the edited "
            "file:\n\n---\n\ndef add(a, b):\n    return a + b",
            "accepted",
        ),
        ("qwen-code", "[Operation Cancelled] Reason: User did not allow tool call", "rejected"),
        (
            "cline",
            '{"query":"edit:/repo/calc.py","result":"Edited /repo/calc.py\\n```diff\\n-2:     '
            'return a - b\\n+2:     return a + b\\n```","success":true}',
            "accepted",
        ),
        (
            "cline",
            '{"error":"This tool call was rejected by the user and not executed. -- NOT a tool '
            'or system failure. Clarify with user before proceeding."}',
            "rejected",
        ),
        ("continue", "Successfully edited /repo/calc.py\nDiff:\nIndex: calc.py", "accepted"),
        ("continue", "Permission denied by user", "rejected"),
    ],
)
def test_each_clients_tool_result_is_read_as_what_became_of_the_call(
    client: str, text: str, verdict: str
) -> None:
    [found] = distill(ANSWER, [result(text)]).found
    assert found.verdict == verdict and found.source.startswith(f"history:{client}:")
    assert found.call_id == "call-0-r1"


def test_only_results_of_the_answers_own_calls_count() -> None:
    # A result naming another call (an earlier turn's, or the model's own words) says
    # nothing of this answer.
    after = [
        result("Edit applied successfully.", call_id="call-0-earlier"),
        {"role": "assistant", "content": "Edit applied successfully."},
    ]
    assert distill(ANSWER, after).found == []


def test_after_a_final_answer_the_users_next_message_is_its_follow_up() -> None:
    final = {"role": "assistant", "content": "Done: add() returns a + b."}
    after = [{"role": "user", "content": "It still fails."}, {"role": "user", "content": "?"}]
    evidence = distill(final, after)
    assert evidence.followup == "It still fails."
    at = datetime.now(UTC)
    [followup] = feedback_of(evidence, "r1", "s1", private=True, at=at)
    # A private run's follow-up is classified here; its text is not kept.
    assert followup.kind == "followup_message" and followup.message is None
    assert followup.dissatisfied is True


def test_aiders_failed_edit_is_unapplicable_not_a_follow_up() -> None:
    final = {"role": "assistant", "content": "calc.py\n<<<<<<< SEARCH\n..."}
    failed = "# 1 SEARCH/REPLACE block failed to match!\n\n## SearchReplaceNoExactMatch: ..."
    evidence = distill(final, [{"role": "user", "content": failed}])
    assert evidence.followup is None
    [rejected] = feedback_of(evidence, "r1", "s1", private=False, at=datetime.now(UTC))
    assert (rejected.kind, rejected.source) == ("edit_rejected", "history:aider:no_match")


def test_an_answer_with_one_call_applied_and_one_refused_sends_both_verdicts() -> None:
    answer = {**ANSWER, "tool_calls": [*ANSWER["tool_calls"], {"id": "call-1-r1"}]}
    after = [
        result("Edit applied successfully."),
        result("The user rejected permission to use this specific tool call.", "call-1-r1"),
    ]
    events = feedback_of(distill(answer, after), "r1", "s1", private=False, at=datetime.now(UTC))
    assert {event.kind for event in events} == {"edit_accepted", "edit_rejected"}


def test_a_call_the_user_aborted_at_codexs_approval_prompt_is_refused_and_a_complaint() -> None:
    aborted = [
        result("Wall time: 11.6 seconds\naborted by user"),
        {"role": "user", "content": "<turn_aborted>\nThe user interrupted the previous turn."},
    ]
    events = feedback_of(distill(ANSWER, aborted), "r1", "s1", private=False, at=datetime.now(UTC))
    assert sorted((event.kind, event.source) for event in events) == [
        ("edit_rejected", "history:codex:aborted"),
        ("followup_message", "history:codex:aborted"),
    ]
    # An interrupt in the user's message alone names no call: a complaint, no refusal.
    alone = feedback_of(
        distill(ANSWER, aborted[1:]), "r1", "s1", private=False, at=datetime.now(UTC)
    )
    assert [event.kind for event in alone] == ["followup_message"]


@pytest.mark.parametrize(
    ("name", "text", "read"),
    [
        ("edit", "Error: oldString not found in content", True),
        ("apply_patch", "error: patch does not apply", True),
        ("replace_in_file", '{"error": "The SEARCH block does not match"}', True),
        ("read_file", "Error: no such file", False),  # a read that failed is no edit's fate
        ("edit", "Edited calc.py; no error", False),
    ],
)
def test_an_edit_call_whose_result_reports_an_error_is_unapplicable_for_any_client(
    name: str, text: str, read: bool
) -> None:
    answer = {**ANSWER, "tool_calls": [{"id": "call-0-r1", "function": {"name": name}}]}
    found = distill(answer, [result(text)]).found
    assert [(f.verdict, f.source) for f in found] == (
        [("unapplicable", "history:any:edit_error")] if read else []
    )


# survival from the files the next request shows


def edit_call(call_id: str, **arguments: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "Edit", "arguments": orjson.dumps(arguments).decode()},
    }


def read_call(call_id: str, path: str) -> dict[str, Any]:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": "Read", "arguments": orjson.dumps({"file_path": path}).decode()},
    }


def served(request_id: str) -> str | None:
    """As the gateway names its calls: `call-<n>-<request id>`."""
    return request_id.split("-", 2)[2] if request_id.startswith("call-") else None


EDIT = edit_call(
    "call-0-r1",
    file_path="/repo/calc.py",
    old_string="def add(a, b):\n    return a - b",
    new_string="def add(a, b):\n    total = a + b\n    return total",
)
EDITED = [
    {"role": "user", "content": "Fix add()."},
    {"role": "assistant", "content": "", "tool_calls": [EDIT]},
    result("The file /repo/calc.py has been updated successfully.", "call-0-r1"),
]


def test_a_later_read_of_the_file_tells_the_share_of_the_edits_lines_still_there() -> None:
    reading = {
        "role": "assistant",
        "content": "",
        "tool_calls": [read_call("call-0-r2", "calc.py")],
    }
    # Claude Code's Read numbers its lines; the user has since changed `return total`.
    shown = "     1→def add(a, b):\n     2→    total = a + b\n     3→    return a + b\n"
    tail = [result(shown, "call-0-r2")]
    [found] = survival([*EDITED, reading], tail, served)
    # Inserted: the two lines the old text did not have; one is still there.
    assert (found.request_id, found.surviving_share, found.source) == (
        "r1",
        0.5,
        "history:any:reread",
    )

    events = survival_feedback([found], [T0], "s1", at=T0 + timedelta(seconds=40))
    assert [(e.kind, e.request_id, e.elapsed_s, e.surviving_share) for e in events] == [
        ("edit_survival", "r1", 40.0, 0.5)
    ]
    assert survival_feedback([found], [None], "s1", at=T0) == []  # acceptance time unknown


@pytest.mark.parametrize(
    ("edit_result", "read_name", "read_result", "call_id"),
    [
        # A refused or failed edit wrote nothing: its lines' absence says nothing.
        ("Error: String to replace not found in file.", "Read", "def add(a, b):", "call-0-r1"),
        (CLAUDE_REFUSED, "Read", "def add(a, b):", "call-0-r1"),
        # Not a read, or a read that failed, shows no file.
        ("Edit applied successfully.", "Bash", "def add(a, b):", "call-0-r1"),
        ("Edit applied successfully.", "Read", "Error: no such file", "call-0-r1"),
        # A call id the gateway did not give names no served edit.
        ("Edit applied successfully.", "Read", "def add(a, b):", "toolu_01abc"),
    ],
)
def test_only_a_served_edit_that_was_applied_and_a_read_that_showed_the_file_count(
    edit_result: str, read_name: str, read_result: str, call_id: str
) -> None:
    edit = {**EDIT, "id": call_id}
    history = [
        {"role": "user", "content": "Fix add()."},
        {"role": "assistant", "content": "", "tool_calls": [edit]},
        result(edit_result, call_id),
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    **read_call("call-0-r2", "/repo/calc.py"),
                    "function": {
                        "name": read_name,
                        "arguments": '{"file_path": "/repo/calc.py"}',
                    },
                }
            ],
        },
    ]
    assert survival(history, [result(read_result, "call-0-r2")], served) == []


def test_a_read_of_part_of_the_file_is_not_read_for_survival() -> None:
    call = read_call("call-0-r2", "calc.py")
    call["function"]["arguments"] = '{"file_path": "calc.py", "offset": 40, "limit": 10}'
    reading = {"role": "assistant", "content": "", "tool_calls": [call]}
    assert survival([*EDITED, reading], [result("    40→x = 1", "call-0-r2")], served) == []


def test_a_file_shown_again_with_every_line_gone_is_a_revert() -> None:
    reading = {
        "role": "assistant",
        "content": "",
        "tool_calls": [read_call("call-0-r2", "calc.py")],
    }
    [found] = survival(
        [*EDITED, reading], [result("def add(a, b):\n    return a - b", "call-0-r2")], served
    )
    assert found.surviving_share == 0.0
