"""Feedback from the IDE: validate the whole batch, check what it refers to, publish once."""

from __future__ import annotations

import uuid
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
from app.gateway.service import Served, request_key
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


async def served_requests(
    redis: Redis, events: Sequence[Feedback], api_key_id: uuid.UUID
) -> list[Served]:
    """What each event's request was served as; 404 unless this key was served it.

    A request served to another key is answered exactly as an unknown one, so request ids
    cannot be probed; a session mismatch is told only to the key that owns the request.
    """
    stored = await redis.mget([request_key(event.request_id) for event in events])
    served = []
    for index, (event, raw) in enumerate(zip(events, stored, strict=True)):
        found = None if raw is None else Served.decode(raw)
        if found is None or found.api_key_id not in (None, str(api_key_id)):
            raise unknown_request(index, event.request_id)
        if found.session_id != event.session_id:
            raise invalid_event(
                index,
                "session_id",
                f"request {event.request_id!r} was served in another session",
                "session_mismatch",
            )
        served.append(found)
    return served


def unknown_request(index: int, request_id: str) -> ApiError:
    """The one answer for a request id this key was not served, whether or not it exists."""
    param = f"events[{index}].request_id"
    return ApiError(
        404,
        f"{param}: no completion with request id {request_id!r} was served to this API key "
        "(or it is too old)",
        type="not_found_error",
        code="unknown_request_id",
        param=param,
    )


def without_content(event: Feedback) -> Feedback:
    """A privacy-mode follow-up: classified here, and its text never leaves the gateway."""
    if isinstance(event, FollowupMessage) and event.message is not None:
        return event.model_copy(
            update={"message": None, "dissatisfied": is_dissatisfied(event.message)}
        )
    return event


async def unseen(redis: Redis, events: Sequence[Feedback]) -> list[Feedback]:
    """The events whose ids this gateway has not accepted before (in this batch or earlier)."""
    unique, ids = [], set()
    for event in events:
        if event.event_id not in ids:
            ids.add(event.event_id)
            unique.append(event)
    if not unique:
        return []
    marked = await redis.mget([seen_key(event.event_id) for event in unique])
    return [event for event, mark in zip(unique, marked, strict=True) if mark is None]


FEEDBACK_SEEN_TTL_S = 15 * 60
"""How long the gateways remember an accepted event id. The IDE retries a batch within seconds;
a copy sent later is spooled again and the workers keep one record per event id (they insert
on conflict do nothing), so this bounds Redis, not correctness: one key of about 100 bytes per
event accepted in the last 15 minutes (at 1,000 events/s, about 90 MB), where remembering ids
for as long as a completion takes feedback (6 h) held 24 times as many."""


async def mark_seen(redis: Redis, events: Sequence[Feedback]) -> None:
    """Remember accepted ids for `FEEDBACK_SEEN_TTL_S`."""
    async with redis.pipeline(transaction=False) as pipe:
        for event in events:
            pipe.set(seen_key(event.event_id), 1, ex=FEEDBACK_SEEN_TTL_S)
        await pipe.execute()


def seen_key(event_id: uuid.UUID) -> str:
    return f"rtrl:fb:{event_id}"


async def accept_feedback(
    redis: Redis,
    sink: EventSink,
    raw_events: Sequence[dict[str, Any]],
    *,
    api_key_id: uuid.UUID,
    privacy: bool,
) -> FeedbackAccepted:
    """Validate all, then publish the new ones to `rtrl.feedback.v1`; all or nothing.

    A privacy-mode completion's feedback is private whatever this call says: privacy was
    decided once, when the completion was served.
    """
    events = parse_events(raw_events)
    served = await served_requests(redis, events, api_key_id)
    events = [
        without_content(event) if privacy or request.privacy else event
        for event, request in zip(events, served, strict=True)
    ]
    # A session's end is this key's: it finalizes no other key's completions.
    events = [
        event.model_copy(update={"api_key_id": api_key_id})
        if isinstance(event, SessionEnd)
        else event
        for event in events
    ]
    # Spooled first, marked seen after: a gateway that dies between the two has the event on
    # its spool, or not at all and the IDE's retry is taken; never marked and lost. Two
    # identical batches at once may both be spooled; workers keep one record per event id.
    new = await unseen(redis, events)
    for event in new:
        sink.publish(FEEDBACK_TOPIC, event.session_id, event)
    await mark_seen(redis, new)
    return FeedbackAccepted(accepted=len(new), duplicates=len(events) - len(new))
