"""Feedback from the IDE: validate the whole batch, check what it refers to, publish once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from app.events import (
    FEEDBACK_TOPIC,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
    feedback_adapter,
)
from app.feedback.schemas import FeedbackAccepted
from app.gateway.service import REQUEST_ID_TTL_S, request_key
from app.gateway.sink import EventSink
from app.http.errors import ApiError
from app.signals.followup import is_dissatisfied

Feedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd


def invalid_event(index: int, field: str | None, message: str, code: str) -> ApiError:
    """A 422 naming the event and field at fault."""
    param = f"events[{index}]" + (f".{field}" if field else "")
    return ApiError(422, f"{param}: {message}", code=code, param=param)


def parse_events(raw_events: Sequence[dict[str, Any]]) -> list[Feedback]:
    """Every event validated with its schema; the first invalid one fails the whole batch."""
    events = []
    for index, raw in enumerate(raw_events):
        try:
            events.append(feedback_adapter.validate_python(raw))
        except ValidationError as exc:
            error = exc.errors()[0]
            # loc is (kind, field, ...) once the kind is known; a bad kind has no loc.
            field = ".".join(str(part) for part in error["loc"][1:])
            if error["type"].startswith("union_tag"):
                field = "kind"
            raise invalid_event(index, field or None, error["msg"], "invalid_event") from None
    return events


async def check_served(redis: Redis, events: Sequence[Feedback]) -> None:
    """Every event names a request this gateway served, in the session it served it in."""
    sessions = await redis.mget([request_key(event.request_id) for event in events])
    for index, (event, session) in enumerate(zip(events, sessions, strict=True)):
        if session is None:
            raise invalid_event(
                index,
                "request_id",
                f"no completion with request id {event.request_id!r} was served (or it is too old)",
                "unknown_request_id",
            )
        served_in = session.decode() if isinstance(session, bytes) else str(session)
        if served_in != event.session_id:
            raise invalid_event(
                index,
                "session_id",
                f"request {event.request_id!r} was served in another session",
                "session_mismatch",
            )


def without_content(event: Feedback) -> Feedback:
    """A privacy-mode follow-up: classified here, and its text never leaves the gateway."""
    if isinstance(event, FollowupMessage) and event.message is not None:
        return event.model_copy(
            update={"message": None, "dissatisfied": is_dissatisfied(event.message)}
        )
    return event


async def first_seen(redis: Redis, events: Sequence[Feedback]) -> list[Feedback]:
    """The events whose ids this gateway has not accepted before (in this batch or earlier)."""
    unique, ids = [], set()
    for event in events:
        if event.event_id not in ids:
            ids.add(event.event_id)
            unique.append(event)
    async with redis.pipeline(transaction=False) as pipe:
        for event in unique:
            pipe.set(f"rtrl:fb:{event.event_id}", 1, nx=True, ex=REQUEST_ID_TTL_S)
        fresh = await pipe.execute()
    return [event for event, new in zip(unique, fresh, strict=True) if new]


async def accept_feedback(
    redis: Redis, sink: EventSink, raw_events: Sequence[dict[str, Any]], *, privacy: bool
) -> FeedbackAccepted:
    """Validate all, then publish the new ones to `rtrl.feedback.v1`; all or nothing."""
    events = parse_events(raw_events)
    await check_served(redis, events)
    if privacy:
        events = [without_content(event) for event in events]
    new = await first_seen(redis, events)
    for event in new:
        sink.publish(FEEDBACK_TOPIC, event.session_id, event)
    return FeedbackAccepted(accepted=len(new), duplicates=len(events) - len(new))
