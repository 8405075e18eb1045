"""Continue's data-destination events, joined to the completions rtrl served and mapped onto
rtrl's feedback kinds.

Continue posts one event per request, fire-and-forget, with no event id: an event's id here
is derived from its key, name and content, so a copy sent twice is counted once. Only events
that carry a verdict on something the model answered become feedback; Continue measures no
edit survival, so an accepted edit it reports is kept as accepted (the window at 0 s).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import Counter
from redis.asyncio import Redis

from app.client_events.schemas import ContinueEventOutcome, ContinueOutcome
from app.feedback.service import FeedbackLimits, accept_feedback
from app.gateway.joins import request_of_answer, request_of_tool_call
from app.gateway.service import Served, request_key
from app.gateway.sink import EventSink
from app.signals.tools import is_edit_tool

CONTINUE_EVENTS = Counter(
    "rtrl_continue_events_total",
    "Events from Continue's data destination, by event name and outcome: mapped onto rtrl "
    "feedback, duplicate, unjoinable (a signal naming no completion this key was served) or "
    "ignored (no signal rtrl keeps).",
    ["event", "outcome"],
)
_NAMES = frozenset(
    {
        "autocomplete",
        "chatFeedback",
        "chatInteraction",
        "editInteraction",
        "editOutcome",
        "nextEdit",
        "nextEditOutcome",
        "nextEditWithHistory",
        "quickEdit",
        "tokensGenerated",
        "toolUsage",
    }
)
_EVENT_IDS = uuid.UUID("6f1c51d2-4f0e-4c8e-9a51-3c0d2f6b7e10")


@dataclass(frozen=True, slots=True)
class Signal:
    """What a Continue event says, and how it names the completion it is about."""

    feedback: list[dict[str, Any]]
    """rtrl feedback fields (a `kind` and what that kind carries), not yet addressed."""
    request_id: str | None = None
    """Named by the event (a response id, a tool call id)."""
    answer_text: str | None = None
    """Quoted by the event: the answer as the client received it."""
    unjoinable: str | None = None
    """Why an event with a verdict cannot be joined, when it names nothing."""


@dataclass(frozen=True, slots=True)
class Ignored:
    reason: str


@dataclass(slots=True)
class Owner:
    """Who posted the event: completions are joined only within the key (and user)."""

    api_key_id: uuid.UUID
    run_owner: str
    privacy: bool


def read_signal(name: str, data: dict[str, Any]) -> Signal | Ignored:
    """The verdict a Continue event carries, or why it carries none rtrl keeps."""
    if name == "toolUsage":
        return _tool_usage(data)
    if name == "nextEditOutcome":
        verdict = data.get("accepted")
        if not isinstance(verdict, bool):
            return Ignored("the next edit was neither accepted nor rejected")
        completion_id = data.get("completionId")
        return Signal(
            [_verdict(verdict)],
            request_id=completion_id if isinstance(completion_id, str) else None,
            unjoinable=None if isinstance(completion_id, str) else "no completionId",
        )
    if name == "editOutcome":
        verdict = data.get("accepted")
        if not isinstance(verdict, bool):
            return Ignored("the edit was neither accepted nor rejected")
        return _quoting(data, [_verdict(verdict)])
    if name == "chatFeedback":
        thumbs = data.get("feedback")
        if not isinstance(thumbs, bool):
            return Ignored("no thumbs up or down")
        return _quoting(data, [{"kind": "followup_message", "dissatisfied": not thumbs}])
    if name == "autocomplete":
        return Ignored("autocomplete (fill-in-the-middle) is not served by the rtrl gateway")
    if name in _NAMES:
        return Ignored(f"{name} carries no verdict on an answer")
    return Ignored("not an event rtrl knows")


def _tool_usage(data: dict[str, Any]) -> Signal | Ignored:
    if not is_edit_tool(data.get("functionName")):
        return Ignored("only edit tools have a verdict (accepted, kept) in rtrl")
    call_id = data.get("toolCallId")
    if not isinstance(call_id, str):
        return Signal([], unjoinable="no toolCallId")
    # Run only once the developer allowed it; a call they refused, or that failed to apply,
    # left nothing of the edit in their files.
    applied = data.get("accepted") is not False and data.get("succeeded") is not False
    request_id = request_of_tool_call(call_id)
    return Signal(
        [_verdict(applied)],
        request_id=request_id,
        unjoinable=None if request_id else "the tool call id was not issued by this gateway",
    )


def _verdict(accepted: bool) -> dict[str, Any]:
    return {"kind": "edit_accepted" if accepted else "edit_rejected"}


def _quoting(data: dict[str, Any], feedback: list[dict[str, Any]]) -> Signal:
    text = data.get("completion")
    if not isinstance(text, str) or not text.strip():
        return Signal(feedback, unjoinable="no completion text to join by (level noCode)")
    return Signal(feedback, answer_text=text)


async def _joined(redis: Redis, owner: Owner, signal: Signal) -> tuple[str, Served] | str:
    """The completion the signal is about, or why none was found."""
    request_id = signal.request_id
    if request_id is None and signal.answer_text is not None:
        request_id = await request_of_answer(redis, owner.run_owner, signal.answer_text)
        if request_id is None:
            return (
                "no answer of this key and user has that text (in the last 6 hours; 5 minutes "
                "for one under 16 characters)"
            )
    if request_id is None:
        return signal.unjoinable or "names no completion"
    served = await served_to(redis, owner, request_id)
    if served is None:
        return "no completion with that id was served to this API key (or it is too old)"
    return request_id, served


async def served_to(redis: Redis, owner: Owner, request_id: str) -> Served | None:
    """What `request_id` was served as, if it was served to the owner's key."""
    raw = await redis.get(request_key(request_id)) if len(request_id) <= 128 else None
    served = None if raw is None else Served.decode(raw)
    if served is None or served.api_key_id != str(owner.api_key_id):
        return None
    return served


def event_id(owner: Owner, name: str, request_id: str, kind: str, data: dict[str, Any]) -> str:
    """The same Continue event, posted twice, gets the same id (Continue sends none)."""
    content = orjson.dumps(data, option=orjson.OPT_SORT_KEYS, default=str)
    scope = f"{owner.api_key_id}\0{name}\0{request_id}\0{kind}\0".encode()
    return str(uuid.uuid5(_EVENT_IDS, (scope + content).hex()))


async def accept_continue_event(
    redis: Redis,
    sink: EventSink,
    owner: Owner,
    name: str,
    data: dict[str, Any],
    limits: FeedbackLimits | None = None,
) -> ContinueEventOutcome:
    """Join one Continue event to its completion and queue the feedback it carries."""
    signal = read_signal(name, data)
    if isinstance(signal, Ignored):
        return _counted(name, "ignored", [], None, signal.reason)
    joined = await _joined(redis, owner, signal)
    if isinstance(joined, str):
        return _counted(name, "unjoinable", [], None, joined)
    request_id, served = joined
    now = datetime.now(UTC).isoformat()
    events = [
        fields
        | {
            "event_id": event_id(owner, name, request_id, fields["kind"], data),
            "session_id": served.session_id,
            "request_id": request_id,
            "occurred_at": now,
        }
        for fields in signal.feedback
    ]
    accepted = await accept_feedback(
        redis,
        sink,
        events,
        api_key_id=owner.api_key_id,
        privacy=owner.privacy,
        limits=limits,
    )
    kinds = [event["kind"] for event in events]
    return _counted(name, "mapped" if accepted.accepted else "duplicate", kinds, request_id)


def _counted(
    name: str,
    outcome: ContinueOutcome,
    kinds: list[str],
    request_id: str | None,
    reason: str | None = None,
) -> ContinueEventOutcome:
    CONTINUE_EVENTS.labels(name if name in _NAMES else "other", outcome).inc()
    return ContinueEventOutcome(
        name=name, outcome=outcome, feedback=kinds, request_id=request_id, reason=reason
    )
