"""What became of a served answer, read by the gateway from the run's next request: feedback
on the answer's request, sent once, for clients that send none themselves."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any

import orjson
import pytest
from anthropic import Anthropic, BadRequestError
from openai import OpenAI

from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC
from sandbox.agent_tasks import TOOLS as AGENT_TOOLS
from tests.conftest import past_the_context

EDIT_SCHEMA = {
    "type": "object",
    "properties": {"file_path": {"type": "string"}},
    "required": ["file_path"],
}
"""One argument: the tiny model's strings run long, and a call cut at max_tokens is no call."""
TASK = "Fix the bug in calc.py: add() must return a plus b."
CLAUDE_REFUSAL = (
    "The user doesn't want to proceed with this tool use. The tool use was rejected (eg. if it "
    "was a file edit, the new_string was NOT written to the file). STOP what you are doing and "
    "wait for the user to tell you how to proceed."
)


def new_id() -> str:
    return f"r-{uuid.uuid4().hex[:12]}"


def until_it_calls(ask: Callable[[], tuple[str, Any, Any]]) -> tuple[str, Any, Any]:
    """A turn whose answer made the tool call it was asked for (request id, answer, call).
    The tiny model mostly calls a tool named in `tool_choice`, but now and then writes no
    call that parses (seen in 1 of about 10 runs): it is asked again, up to three times."""
    for _ in range(3):
        request_id, answer, call = ask()
        if call is not None:
            return request_id, answer, call
    raise AssertionError("the model made no tool call in three turns that named the tool")


def chat_client(gateway_server: Any, ide_key: str) -> OpenAI:
    """A Chat Completions client of one session (as opencode sends it: `x-session-id`)."""
    return OpenAI(
        base_url=f"{gateway_server.url}/v1",
        api_key=ide_key,
        default_headers={"x-session-id": str(uuid.uuid4())},
        max_retries=0,
    )


def feedback_on(kafka: Any, since: dict[int, int], request_id: str, count: int) -> list[dict]:
    events = kafka.read(
        FEEDBACK_TOPIC,
        since,
        until=lambda read: sum(e["request_id"] == request_id for e in read) >= count,
        timeout=10,
    )
    return [event for event in events if event["request_id"] == request_id]


@pytest.mark.parametrize("refused_request", ["served", "past the context"])
def test_a_claude_code_refusal_and_interrupt_reject_the_edit_that_asked_once(
    gateway_server: Any, ide_key: str, kafka: Any, refused_request: str
) -> None:
    client = Anthropic(
        base_url=gateway_server.url,
        auth_token=ide_key,
        default_headers={"X-Claude-Code-Session-Id": str(uuid.uuid4())},
        max_retries=0,
    )
    tools = [{"name": "Edit", "description": "Edit a file.", "input_schema": EDIT_SCHEMA}]
    task = [{"role": "user", "content": TASK}]
    since = kafka.end_offsets(FEEDBACK_TOPIC)

    def ask_for_an_edit() -> tuple[str, Any, Any]:
        edit_id = new_id()
        edit = client.messages.create(
            model="claude",
            max_tokens=160,
            messages=task,
            tools=tools,
            tool_choice={"type": "tool", "name": "Edit"},
            extra_headers={"X-Request-Id": edit_id},
        )
        calls = [block for block in edit.content if block.type == "tool_use"]
        return edit_id, edit, calls[0] if calls else None

    edit_id, edit, call = until_it_calls(ask_for_an_edit)
    # What Claude Code sends when the user presses Esc on the permission prompt, then speaks.
    refused = [
        *task,
        {"role": "assistant", "content": [block.model_dump() for block in edit.content]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": CLAUDE_REFUSAL,
                    "is_error": True,
                },
                {"type": "text", "text": "[Request interrupted by user for tool use]"},
                {"type": "text", "text": "No, keep add() and fix sub() instead."},
            ],
        },
    ]
    if refused_request == "past the context":
        # The user pastes a log longer than the model's context: the request is refused,
        # and still says what became of the edit.
        log = past_the_context("Here is the log. ")
        refused[-1]["content"].append({"type": "text", "text": log})
    answered = []
    for _ in range(2):  # the second request re-sends the same history: nothing new
        try:
            client.messages.create(
                model="claude",
                max_tokens=4,
                messages=refused,
                tools=tools,
                extra_headers={"X-Request-Id": new_id()},
            )
            answered.append("served")
        except BadRequestError as exc:
            assert "prompt is too long" in exc.message, exc
            answered.append("past the context")
    assert answered == [refused_request] * 2

    events = feedback_on(kafka, since, edit_id, 3)
    assert sorted((e["kind"], e["source"]) for e in events) == [
        ("edit_rejected", "history:claude-code:rejected"),
        ("followup_message", "history:claude-code:interrupted"),
    ]
    followup = next(e for e in events if e["kind"] == "followup_message")
    # The model's own words are never evidence; the interrupt is the user's.
    assert followup["dissatisfied"] is True and followup["message"] is None


def test_an_applied_edit_is_accepted_and_the_next_message_after_a_final_answer_follows_up(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # opencode's words, over Chat Completions.
    client = chat_client(gateway_server, ide_key)
    tools = [{"type": "function", "function": {"name": "edit", "parameters": EDIT_SCHEMA}}]
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    since = kafka.end_offsets(FEEDBACK_TOPIC)
    completions_since = kafka.end_offsets(COMPLETIONS_TOPIC)

    def turn(**params: Any) -> tuple[str, Any]:
        request_id = new_id()
        answer = client.chat.completions.create(
            model="rtrl",
            messages=history,
            tools=tools,
            max_tokens=160,
            extra_headers={"X-Request-Id": request_id},
            **params,
        )
        return request_id, answer.choices[0].message

    def ask_for_an_edit() -> tuple[str, Any, Any]:
        edit_id, edit = turn(tool_choice={"type": "function", "function": {"name": "edit"}})
        return edit_id, edit, (edit.tool_calls or [None])[0]

    edit_id, edit, call = until_it_calls(ask_for_an_edit)
    history += [
        edit.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Edit applied successfully."},
    ]
    final_id, final = turn(tool_choice="none")
    history += [
        {"role": "assistant", "content": final.content},
        {"role": "user", "content": "That is wrong, the tests still fail."},
    ]
    last_id, _ = turn(tool_choice="none")

    [accepted] = feedback_on(kafka, since, edit_id, 1)
    assert (accepted["kind"], accepted["source"]) == ("edit_accepted", "history:opencode:applied")
    [followup] = feedback_on(kafka, since, final_id, 1)
    assert followup["kind"] == "followup_message"
    assert followup["message"] == "That is wrong, the tests still fail."
    # The turns are one run: the evidence landed on the turns the history continued.
    served = kafka.read(
        COMPLETIONS_TOPIC,
        completions_since,
        until=kafka.for_requests({edit_id, final_id, last_id}),
    )
    parents = {e["request_id"]: e["parent_request_id"] for e in served}
    assert (parents[final_id], parents[last_id]) == (edit_id, final_id)


def test_a_side_request_after_a_final_answer_is_marked_and_is_no_follow_up(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # Claude Code compacting its history: the whole conversation, then its own instruction.
    client = OpenAI(base_url=f"{gateway_server.url}/v1", api_key=ide_key, max_retries=0)
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    since = kafka.end_offsets(FEEDBACK_TOPIC)
    completions_since = kafka.end_offsets(COMPLETIONS_TOPIC)
    final_id, summary_id = new_id(), new_id()
    final = client.chat.completions.create(
        model="rtrl", messages=history, max_tokens=8, extra_headers={"X-Request-Id": final_id}
    )
    compact = "Your task is to create a detailed summary of the conversation so far."
    history += [
        {"role": "assistant", "content": final.choices[0].message.content},
        {"role": "user", "content": compact},
    ]
    client.chat.completions.create(
        model="rtrl", messages=history, max_tokens=8, extra_headers={"X-Request-Id": summary_id}
    )

    served = kafka.read(
        COMPLETIONS_TOPIC, completions_since, until=kafka.for_requests({final_id, summary_id})
    )
    marked = {e["request_id"]: e["side_request"] for e in served}
    assert (marked[final_id], marked[summary_id]) == (None, "summary")
    assert feedback_on(kafka, since, final_id, 1) == []


def test_a_later_read_of_the_edited_file_is_the_edits_survival_window(
    gateway_server: Any, ide_key: str, kafka: Any
) -> None:
    # The sandbox's tools, which the shipped base learned to call, over Chat Completions: an
    # edit applied, then the file read again. The tiny model picks its own files (after an
    # edit it mostly reads another, or none): the client names each turn it continues
    # (X-Rtrl-Parent-Request-Id), and its copy of the calls names one file, as a real
    # agent's would when it re-reads what it edited.
    client = chat_client(gateway_server, ide_key)
    history: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    since = kafka.end_offsets(FEEDBACK_TOPIC)

    def turn(tool: str, parent: str | None, **copied: str) -> tuple[str, dict[str, Any], str]:
        """A served turn that called `tool`, as the client's history holds it (its arguments
        `copied`), its request id and its call's id."""

        def ask() -> tuple[str, Any, Any]:
            request_id = new_id()
            answer = (
                client.chat.completions.create(
                    model="rtrl",
                    messages=history,
                    tools=AGENT_TOOLS,
                    tool_choice={"type": "function", "function": {"name": tool}},
                    max_tokens=160,
                    extra_headers={"X-Request-Id": request_id}
                    | ({"X-Rtrl-Parent-Request-Id": parent} if parent else {}),
                )
                .choices[0]
                .message
            )
            calls = [c for c in answer.tool_calls or () if c.function.name == tool]
            return request_id, answer, calls[0] if calls else None

        request_id, answer, call = until_it_calls(ask)
        message = answer.model_dump(exclude_none=True)
        message["tool_calls"] = [
            {
                **message["tool_calls"][0],
                "function": {"name": tool, "arguments": orjson.dumps(copied).decode()},
            }
        ]
        return request_id, message, call.id

    edit = {
        "path": "calc.py",
        "old_string": "return a - b",
        "new_string": "total = a + b\nreturn total",
    }
    edit_id, edited, edit_call = turn("edit_file", None, **edit)
    history += [
        edited,
        {"role": "tool", "tool_call_id": edit_call, "content": "Edit applied successfully."},
    ]
    read_id, reading, read_call = turn("read_file", edit_id, path="calc.py")
    # The file as the read shows it, numbered as Claude Code's Read numbers it: one of the
    # edit's two lines is still there, the other the user changed.
    shown = ["def add(a, b):", "    total = a + b", "    return a + b"]
    history += [
        reading,
        {
            "role": "tool",
            "tool_call_id": read_call,
            "content": "\n".join(f"{n:>6}→{line}" for n, line in enumerate(shown, 1)),
        },
    ]
    for _ in range(2):  # a retry re-sends the same history: one window
        client.chat.completions.create(
            model="rtrl",
            messages=history,
            tools=AGENT_TOOLS,
            tool_choice="none",
            max_tokens=4,
            extra_headers={"X-Request-Id": new_id(), "X-Rtrl-Parent-Request-Id": read_id},
        )

    events = feedback_on(kafka, since, edit_id, 2)
    kinds = sorted((e["kind"], e["source"]) for e in events)
    assert kinds == [
        ("edit_accepted", "history:opencode:applied"),
        ("edit_survival", "history:any:reread"),
    ]
    window = next(e for e in events if e["kind"] == "edit_survival")
    assert window["surviving_share"] == 0.5 and not window["censored"]
    accepted = next(e for e in events if e["kind"] == "edit_accepted")
    # The window is timed from the acceptance, as the client's own report would be.
    elapsed = datetime.fromisoformat(window["occurred_at"]) - datetime.fromisoformat(
        accepted["occurred_at"]
    )
    assert window["elapsed_s"] == pytest.approx(elapsed.total_seconds(), abs=0.01)
