"""Feedback from the IDE: validate the whole batch, check what it refers to, publish once."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from prometheus_client import Counter
from pydantic import ValidationError
from redis.asyncio import Redis

from app.config import Settings
from app.events import (
    FEEDBACK_KINDS,
    FEEDBACK_TOPIC,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
    feedback_adapter,
)
from app.feedback.schemas import FeedbackAccepted
from app.gateway.service import REQUEST_ID_TTL_S, Served, request_key
from app.gateway.sink import EventSink
from app.http.errors import ApiError
from app.signals.followup import is_dissatisfied

Feedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd

FEEDBACK_LIMITED = Counter(
    "rtrl_feedback_limited_total",
    "Feedback batches refused (409 feedback_limit_reached) because an event would take its "
    "request past the API key's limit for that kind, by the kind of the event named.",
    ["kind"],
)
for _kind in FEEDBACK_KINDS:
    FEEDBACK_LIMITED.labels(_kind)


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


_DEFAULTS = Settings.model_fields


@dataclass(frozen=True, slots=True)
class FeedbackLimits:
    """Most events of each kind one API key may send on one request; see
    `reserve_within_limits`."""

    verdicts: int = _DEFAULTS["feedback_verdicts_per_request"].default
    survival_reports: int = _DEFAULTS["feedback_survival_reports_per_request"].default
    followups: int = _DEFAULTS["feedback_followups_per_request"].default
    session_ends: int = _DEFAULTS["feedback_session_ends_per_request"].default

    @classmethod
    def from_settings(cls, settings: Settings) -> FeedbackLimits:
        return cls(
            verdicts=settings.feedback_verdicts_per_request,
            survival_reports=settings.feedback_survival_reports_per_request,
            followups=settings.feedback_followups_per_request,
            session_ends=settings.feedback_session_ends_per_request,
        )

    def by_kind(self) -> dict[str, int]:
        return {
            "edit_accepted": self.verdicts,
            "edit_rejected": self.verdicts,
            "edit_survival": self.survival_reports,
            "followup_message": self.followups,
            "session_end": self.session_ends,
        }


# Atomic, so concurrent batches cannot both take the last place. Each counted key is a hash
# of the event ids it holds (event id -> kind): an event counted once is never counted again,
# so a batch retried after a gateway died between counting and spooling is still taken.
_RESERVE = """
local ttl = tonumber(ARGV[1])
local limits = cjson.decode(ARGV[2])
local groups = cjson.decode(ARGV[3])
for i, key in ipairs(KEYS) do
  local held = redis.call('HGETALL', key)
  local known, counts = {}, {}
  for j = 1, #held, 2 do
    known[held[j]] = true
    counts[held[j + 1]] = (counts[held[j + 1]] or 0) + 1
  end
  for _, event in ipairs(groups[i]) do
    if not known[event[1]] then
      known[event[1]] = true
      counts[event[2]] = (counts[event[2]] or 0) + 1
      if counts[event[2]] > limits[event[2]] then
        return event[1]
      end
    end
  end
end
for i, key in ipairs(KEYS) do
  for _, event in ipairs(groups[i]) do
    redis.call('HSETNX', key, event[1], event[2])
  end
  redis.call('EXPIRE', key, ttl)
end
return false
"""


def limit_key(api_key_id: uuid.UUID, request_id: str) -> str:
    """The Redis hash of the events this key sent on one request (event id -> kind)."""
    return f"rtrl:fbn:{api_key_id}:{request_id}"


async def reserve_within_limits(
    redis: Redis,
    events: Sequence[Feedback],
    indexes: Mapping[uuid.UUID, int],
    *,
    api_key_id: uuid.UUID,
    limits: FeedbackLimits,
) -> None:
    """Count the new events against the key's limits per request and kind; all or none.

    One over its limit refuses the batch with a 409 naming it (`indexes`: each event id's
    place in the batch as sent), and nothing is counted. The counts last as long as the
    request takes feedback (`REQUEST_ID_TTL_S` after the last event counted).
    """
    groups: dict[str, list[tuple[str, str]]] = {}
    for event in events:
        groups.setdefault(limit_key(api_key_id, event.request_id), []).append(
            (str(event.event_id), event.kind)
        )
    if not groups:
        return
    over = await redis.eval(
        _RESERVE,
        len(groups),
        *groups,
        REQUEST_ID_TTL_S,
        orjson.dumps(limits.by_kind()),
        orjson.dumps(list(groups.values())),
    )
    if over is None:
        return
    event_id = uuid.UUID(over.decode() if isinstance(over, bytes) else str(over))
    event = next(event for event in events if event.event_id == event_id)
    FEEDBACK_LIMITED.labels(event.kind).inc()
    raise over_limit(indexes[event_id], event, limits.by_kind()[event.kind])


def over_limit(index: int, event: Feedback, limit: int) -> ApiError:
    """The 409 for an event past its key's limit: the event is named, so a client that drops
    it can send the rest of the batch again."""
    param = f"events[{index}]"
    return ApiError(
        409,
        f"{param}: this API key may send at most {limit} {event.kind} event(s) on request "
        f"{event.request_id!r}, and has; nothing in this batch was taken: send the batch "
        "again without this event",
        type="conflict_error",
        code="feedback_limit_reached",
        param=param,
    )


async def accept_feedback(
    redis: Redis,
    sink: EventSink,
    raw_events: Sequence[dict[str, Any]],
    *,
    api_key_id: uuid.UUID,
    privacy: bool,
    limits: FeedbackLimits | None = None,
    now: datetime | None = None,
    source: str | None = None,
) -> FeedbackAccepted:
    """Validate all, then publish the new ones to `rtrl.feedback.v1`; all or nothing.

    A privacy-mode completion's feedback is private whatever this call says: privacy was
    decided once, when the completion was served. Each event is stamped with the time this
    gateway received it (`received_at`) and with `source` (None: the client reported it; an
    adapter names what it read), whatever the client sent. An event that would take its
    request past this key's limit for its kind (`FeedbackLimits`) refuses the batch (409).
    """
    events = parse_events(raw_events)
    served = await served_requests(redis, events, api_key_id)
    received_at = now or datetime.now(UTC)
    events = [
        without_content(event) if privacy or request.privacy else event
        for event, request in zip(events, served, strict=True)
    ]
    # A session's end is this key's: it finalizes no other key's completions.
    events = [
        event.model_copy(
            update={"received_at": received_at, "source": source}
            | ({"api_key_id": api_key_id} if isinstance(event, SessionEnd) else {})
        )
        for event in events
    ]
    indexes: dict[uuid.UUID, int] = {}
    for index, event in enumerate(events):
        indexes.setdefault(event.event_id, index)
    # Counted, spooled, then marked seen: a gateway that dies between any two has the event
    # on its spool, or not at all and the IDE's retry is taken (counting an id again adds
    # nothing); never marked and lost. Two identical batches at once may both be spooled;
    # workers keep one record per event id.
    new = await unseen(redis, events)
    await reserve_within_limits(
        redis, new, indexes, api_key_id=api_key_id, limits=limits or FeedbackLimits()
    )
    for event in new:
        sink.publish(FEEDBACK_TOPIC, event.session_id, event)
    await mark_seen(redis, new)
    return FeedbackAccepted(accepted=len(new), duplicates=len(events) - len(new))
