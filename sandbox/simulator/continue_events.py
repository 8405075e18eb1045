"""The events Continue's data destination posts, built as Continue builds them.

Each is one HTTP body, `{name, data, schema, level, profileId}`, shaped by the developer's
destination: schema 0.2.0 carries the base fields (eventName, schema, timestamp or createdAt,
userId, userAgent, selectedProfileId) and `toolUsage`; schema 0.1.0 has no `toolUsage` and
a smaller `chatFeedback`; level `noCode` drops whatever carries code or text (the tool's
arguments and output, the prompt and the completion).
"""

from __future__ import annotations

import hashlib
from datetime import datetime
from typing import Any

from sandbox.simulator.clients import Destination
from sandbox.simulator.toolcalls import IdeToolCall

PROFILE_ID = "local"
"""The profile of a Continue that uses its local config.yaml."""
USER_AGENT = "Visual Studio Code/1.99.3 (Continue/1.1.49)"
MODEL_TITLE = "rtrl"
"""The title the developer gave the rtrl model in their config.yaml."""


def continue_user_id(user_id: str) -> str:
    """Continue's `userId`: the editor's machine id, stable per developer (not `X-User-Id`)."""
    return hashlib.sha256(f"machine:{user_id}".encode()).hexdigest()


def timestamp(at: datetime) -> str:
    """An instant as JavaScript's `Date.toISOString` writes it."""
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def envelope(name: str, data: dict[str, Any], destination: Destination) -> dict[str, Any]:
    """The body one event is posted as."""
    return {
        "name": name,
        "data": data,
        "schema": destination.schema,
        "level": destination.level,
        "profileId": PROFILE_ID,
    }


def tool_usage(
    call: IdeToolCall,
    *,
    output: str,
    accepted: bool,
    succeeded: bool,
    user_id: str,
    destination: Destination,
    at: datetime,
) -> dict[str, Any] | None:
    """The `toolUsage` event of a call the IDE ran (or the developer refused); None where the
    destination's schema has no such event (0.1.0)."""
    if destination.schema == "0.1.0":
        return None
    data: dict[str, Any] = {
        "eventName": "toolUsage",
        "schema": destination.schema,
        "timestamp": timestamp(at),
        "userId": continue_user_id(user_id),
        "userAgent": USER_AGENT,
        "selectedProfileId": PROFILE_ID,
        "toolCallId": call.call_id,
        "functionName": call.name,
        "accepted": accepted,
        "succeeded": succeeded,
    }
    if destination.level == "all":
        data["functionArgs"] = call.arguments
        data["parsedArgs"] = call.parsed if call.parsed is not None else {}
        # A refused call was never run: it has no output.
        data["output"] = (
            [{"name": call.name, "description": "Tool output", "content": output}]
            if accepted
            else []
        )
    return envelope("toolUsage", data, destination)


def chat_feedback(
    *,
    satisfied: bool,
    prompt: str,
    completion: str,
    session_id: str,
    user_id: str,
    destination: Destination,
    at: datetime,
) -> dict[str, Any]:
    """The `chatFeedback` event of a thumbs up (`satisfied`) or down on an answer."""
    data: dict[str, Any]
    if destination.schema == "0.1.0":
        data = {"modelTitle": MODEL_TITLE, "completionOptions": {}}
    else:
        data = {
            "eventName": "chatFeedback",
            "schema": destination.schema,
            "createdAt": timestamp(at),
            "userId": continue_user_id(user_id),
            "userAgent": USER_AGENT,
            "selectedProfileId": PROFILE_ID,
            "modelTitle": MODEL_TITLE,
        }
    data |= {"sessionId": session_id, "feedback": satisfied}
    if destination.level == "all":
        data |= {"prompt": prompt, "completion": completion}
    return envelope("chatFeedback", data, destination)
