"""Continue's data-destination events, as the simulated Continue posts them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sandbox.simulator.clients import Destination
from sandbox.simulator.continue_events import (
    PROFILE_ID,
    chat_feedback,
    continue_user_id,
    timestamp,
    tool_usage,
)
from sandbox.simulator.toolcalls import read_tool_call

AT = datetime(2025, 3, 4, 5, 6, 7, 891_234, tzinfo=UTC)
EDIT = read_tool_call(
    {
        "id": "call-0-req-1",
        "type": "function",
        "function": {
            "name": "edit_file",
            "arguments": '{"path": "calc.py", "old_string": "return x", "new_string": "pass"}',
        },
    }
)
BASE_FIELDS = {"eventName", "schema", "userId", "userAgent", "selectedProfileId"}


def test_tool_usage_carries_the_call_id_the_arguments_and_the_verdict() -> None:
    event = tool_usage(
        EDIT,
        output="ok",
        accepted=True,
        succeeded=True,
        user_id="sim-0-00001",
        destination=Destination(),
        at=AT,
    )

    assert event is not None
    assert {k: event[k] for k in ("name", "schema", "level", "profileId")} == {
        "name": "toolUsage",
        "schema": "0.2.0",
        "level": "all",
        "profileId": PROFILE_ID,
    }
    data = event["data"]
    assert data.keys() >= BASE_FIELDS
    assert data["eventName"] == "toolUsage" and data["timestamp"] == "2025-03-04T05:06:07.891Z"
    assert data["toolCallId"] == "call-0-req-1" and data["functionName"] == "edit_file"
    assert data["functionArgs"] == EDIT.arguments
    assert data["parsedArgs"] == {"path": "calc.py", "old_string": "return x", "new_string": "pass"}
    assert data["output"] == [{"name": "edit_file", "description": "Tool output", "content": "ok"}]
    assert data["accepted"] is True and data["succeeded"] is True
    assert data["userId"] == continue_user_id("sim-0-00001") != "sim-0-00001"


def test_a_refused_call_has_no_output_and_no_code_level_drops_the_arguments() -> None:
    refused = tool_usage(
        EDIT,
        output="ok",
        accepted=False,
        succeeded=False,
        user_id="u",
        destination=Destination(),
        at=AT,
    )
    assert refused is not None and refused["data"]["output"] == []
    no_code = tool_usage(
        EDIT,
        output="ok",
        accepted=True,
        succeeded=True,
        user_id="u",
        destination=Destination(level="noCode"),
        at=AT,
    )
    assert no_code is not None and no_code["level"] == "noCode"
    assert not {"functionArgs", "parsedArgs", "output"} & no_code["data"].keys()
    assert no_code["data"]["toolCallId"] == "call-0-req-1"


def test_schema_0_1_0_has_no_tool_usage_event() -> None:
    old = Destination(schema="0.1.0")
    assert (
        tool_usage(
            EDIT, output="", accepted=True, succeeded=True, user_id="u", destination=old, at=AT
        )
        is None
    )


def test_chat_feedback_quotes_the_prompt_and_the_answer_as_received() -> None:
    answer = "```python\ndef f(x):\n    return x * 3\n```\n"
    event = chat_feedback(
        satisfied=False,
        prompt="Write f(x) that returns x times 3.",
        completion=answer,
        session_id="5b0f1b8e-2d7a-4c3e-9b1a-0c1d2e3f4a5b",
        user_id="u",
        destination=Destination(),
        at=AT,
    )

    assert event["name"] == "chatFeedback" and event["schema"] == "0.2.0"
    data = event["data"]
    assert data.keys() >= BASE_FIELDS and data["createdAt"] == "2025-03-04T05:06:07.891Z"
    assert data["feedback"] is False and data["modelTitle"] == "rtrl"
    assert data["completion"] == answer and data["prompt"].startswith("Write f(x)")
    assert data["sessionId"] == "5b0f1b8e-2d7a-4c3e-9b1a-0c1d2e3f4a5b"


def test_chat_feedback_without_code_or_on_the_old_schema() -> None:
    common: dict[str, Any] = {
        "satisfied": True,
        "prompt": "p",
        "completion": "c",
        "session_id": "s",
        "user_id": "u",
        "at": AT,
    }
    no_code = chat_feedback(destination=Destination(level="noCode"), **common)
    assert not {"prompt", "completion"} & no_code["data"].keys()
    assert no_code["data"]["feedback"] is True

    old = chat_feedback(destination=Destination(schema="0.1.0"), **common)
    assert old["schema"] == "0.1.0"
    assert old["data"] == {
        "modelTitle": "rtrl",
        "completionOptions": {},
        "sessionId": "s",
        "feedback": True,
        "prompt": "p",
        "completion": "c",
    }


def test_timestamps_are_written_as_javascript_writes_them() -> None:
    assert timestamp(datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)) == "2025-01-02T03:04:05.000Z"
