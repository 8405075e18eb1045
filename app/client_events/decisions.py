"""Claude Code's edit decisions, read from its telemetry export, joined to the edit calls
rtrl served and queued as `edit_accepted` or `edit_rejected` feedback.

A decision with a `tool_use_id` names its call exactly (the call ids the gateway answers with
carry the request id). Without one (older Claude Codes, and always the counter), it joins the
latest call of its tool that this key was served in that session at or before the decision,
among those with no decision yet (two calls of one answer in their order); when there is none,
the earliest such call served after it within the clock skew (the client's clock is not the
gateway's).

The same decision counts once however it arrives: what each call was decided, and by which
event, is remembered per session, so an export sent again joins the same calls, a log event
and the counter that counts it agree (a counter's data point adds only the decisions of its
window that no event or earlier point brought), and each verdict's event id is derived from
its call and kind.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import orjson
from prometheus_client import Counter
from redis.asyncio import Redis
from redis.exceptions import WatchError

from app.client_events.otlp import Decision
from app.client_events.service import Owner, served_to
from app.feedback.service import FeedbackLimits, accept_feedback
from app.gateway.joins import SESSION_CALLS_TTL_S, request_of_tool_call, session_calls
from app.gateway.sink import EventSink
from app.http.errors import ApiError

Signal = Literal["logs", "metrics"]
Outcome = Literal["mapped", "duplicate", "unjoinable", "ignored"]

OTLP_RECORDS = Counter(
    "rtrl_otlp_records_total",
    "Records of OTLP exports (log records, metric data points), by signal and outcome: an "
    "edit decision mapped onto rtrl feedback, duplicate (counted before), unjoinable (no edit "
    "call of this key and session to join, or over the key's feedback limit) or ignored (not "
    "an edit decision).",
    ["signal", "outcome"],
)
for _signal in ("logs", "metrics"):
    for _outcome in ("mapped", "duplicate", "unjoinable", "ignored"):
        OTLP_RECORDS.labels(_signal, _outcome)

_EVENT_IDS = uuid.UUID("0b8f3f63-2a7e-4c39-9f0c-5d1e8a7c4b21")
_POSITION = re.compile(r"call-(?:\d+\.)?(\d+)-")
_WATCH_TRIES = 8


@dataclass(slots=True)
class Joined:
    """What became of one decision (a counter's data point may carry several)."""

    mapped: int = 0
    duplicate: int = 0
    unjoinable: int = 0
    reason: str | None = None

    @property
    def outcome(self) -> Outcome:
        if self.mapped:
            return "mapped"
        if self.duplicate and not self.unjoinable:
            return "duplicate"
        return "unjoinable"


@dataclass(slots=True)
class Plan:
    """How a decision joins the session's calls, before it is written."""

    calls: list[str] = field(default_factory=list)
    """The calls it decides (new, or decided by it before)."""
    recorded: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What to remember per call decided."""
    duplicate: int = 0
    """Decisions of a counter that events or earlier points already brought."""
    unjoinable: int = 0


def decided_key(api_key_id: str, session_id: str) -> str:
    """The hash of a session's decided calls (call id -> how it was decided)."""
    return f"rtrl:decided:{api_key_id}:{session_id}"


def event_id(api_key_id: uuid.UUID, call_id: str, kind: str) -> str:
    """One verdict per call and kind, whichever signal and copy brought it."""
    return str(uuid.uuid5(_EVENT_IDS, f"{api_key_id}\0{call_id}\0{kind}"))


def plan(
    decision: Decision,
    decided: Mapping[str, dict[str, Any]],
    calls: Sequence[tuple[str, str, float]],
    *,
    exact: str | None,
    skew_s: float,
) -> Plan:
    """Which calls `decision` decides, given the session's `decided` calls and its served
    edit `calls` (id, tool, served at); `exact`: the call its tool_use_id names."""
    if decision.identity is not None:
        return _plan_event(decision, decided, calls, exact=exact, skew_s=skew_s)
    start = decision.window_start or 0.0
    brought = sum(
        1
        for record in decided.values()
        if _same_verdict(record, decision) and start < record["at"] <= decision.at
    )
    result = Plan(duplicate=min(brought, decision.count))
    taken = dict(decided)
    for _ in range(decision.count - brought):
        call = _latest_undecided(decision, taken, calls, skew_s)
        if call is None:
            result.unjoinable += 1
            continue
        taken[call] = result.recorded[call] = _record(decision, "metrics")
        result.calls.append(call)
    return result


def _plan_event(
    decision: Decision,
    decided: Mapping[str, dict[str, Any]],
    calls: Sequence[tuple[str, str, float]],
    *,
    exact: str | None,
    skew_s: float,
) -> Plan:
    for call, record in decided.items():
        if record.get("identity") == decision.identity:
            return Plan(calls=[call])  # the same event, exported again
    if exact is not None:
        before = decided.get(exact)
        if before is None:
            return Plan(calls=[exact], recorded={exact: _record(decision, "logs")})
        if before["by"] == "metrics" and not before.get("identity"):
            return Plan(calls=[exact], recorded={exact: before | {"identity": decision.identity}})
        return Plan(calls=[exact])
    # The counter may have brought this decision first: the event joins what it joined.
    for call, record in decided.items():
        if (
            record["by"] == "metrics"
            and not record.get("identity")
            and _same_verdict(record, decision)
            and record["window_start"] < decision.at <= record["at"]
        ):
            return Plan(calls=[call], recorded={call: record | {"identity": decision.identity}})
    latest = _latest_undecided(decision, decided, calls, skew_s)
    if latest is None:
        return Plan(unjoinable=1)
    return Plan(calls=[latest], recorded={latest: _record(decision, "logs")})


def _latest_undecided(
    decision: Decision,
    decided: Mapping[str, dict[str, Any]],
    calls: Sequence[tuple[str, str, float]],
    skew_s: float,
) -> str | None:
    open_calls = [
        (served_at, -_position(call), call)
        for call, tool, served_at in calls
        if tool == decision.tool_name and call not in decided
    ]
    before = [entry for entry in open_calls if entry[0] <= decision.at]
    if before:
        return max(before)[2]
    after = [(at, -order, call) for at, order, call in open_calls if at <= decision.at + skew_s]
    return min(after)[2] if after else None


def _position(call_id: str) -> int:
    match = _POSITION.match(call_id)
    return int(match.group(1)) if match else 0


def _same_verdict(record: Mapping[str, Any], decision: Decision) -> bool:
    return (record["tool"], record["accepted"], record["source"]) == (
        decision.tool_name,
        decision.accepted,
        decision.source,
    )


def _record(decision: Decision, by: Signal) -> dict[str, Any]:
    """What is remembered of a decided call: its verdict, when and how; never content."""
    return {
        "tool": decision.tool_name,
        "accepted": decision.accepted,
        "source": decision.source,
        "at": decision.at,
        "window_start": decision.window_start,
        "identity": decision.identity,
        "by": by,
    }


async def accept_decisions(
    redis: Redis,
    sink: EventSink,
    owner: Owner,
    signal: Signal,
    decisions: Sequence[Decision],
    *,
    limits: FeedbackLimits,
    skew_s: float,
) -> list[Joined]:
    """Join each decision to the calls it decides and queue its verdicts, in order."""
    return [
        await _accept(redis, sink, owner, signal, decision, limits, skew_s)
        for decision in decisions
    ]


async def _accept(
    redis: Redis,
    sink: EventSink,
    owner: Owner,
    signal: Signal,
    decision: Decision,
    limits: FeedbackLimits,
    skew_s: float,
) -> Joined:
    session_id, exact = decision.session_id, None
    if decision.tool_use_id is not None:
        request_id = request_of_tool_call(decision.tool_use_id)
        served = await served_to(redis, owner, request_id) if request_id else None
        if served is not None:
            session_id, exact = served.session_id, decision.tool_use_id
        elif not session_id:
            return _counted(signal, Joined(unjoinable=1, reason=_NOT_OURS))
    planned = await _planned(redis, owner, session_id, decision, exact, skew_s)
    joined = Joined(duplicate=planned.duplicate, unjoinable=planned.unjoinable)
    if planned.unjoinable:
        joined.reason = (
            f"no {decision.tool_name} call without a decision was served to this API key in "
            f"session {session_id!r} by then (or it is too old)"
        )
    kind = "edit_accepted" if decision.accepted else "edit_rejected"
    for call in planned.calls:
        request_id = request_of_tool_call(call)
        served = await served_to(redis, owner, request_id) if request_id else None
        if request_id is None or served is None:
            joined.unjoinable += 1
            joined.reason = _NOT_OURS
            continue
        event = {
            "kind": kind,
            "event_id": event_id(owner.api_key_id, call, kind),
            "session_id": served.session_id,
            "request_id": request_id,
            "occurred_at": datetime.fromtimestamp(decision.at, UTC).isoformat(),
        }
        try:
            accepted = await accept_feedback(
                redis,
                sink,
                [event],
                api_key_id=owner.api_key_id,
                privacy=owner.privacy,
                limits=limits,
                source=decision.feedback_source,
            )
        except ApiError as exc:  # over the key's limit for the request
            joined.unjoinable += 1
            joined.reason = exc.message
            continue
        if accepted.accepted:
            joined.mapped += 1
        else:
            joined.duplicate += 1
    return _counted(signal, joined)


_NOT_OURS = "no completion with that tool_use_id was served to this API key (or it is too old)"


async def _planned(
    redis: Redis,
    owner: Owner,
    session_id: str,
    decision: Decision,
    exact: str | None,
    skew_s: float,
) -> Plan:
    """The decision's plan, written atomically with what it read (exports of one session may
    arrive at once: logs and metrics are sent apart)."""
    key = decided_key(str(owner.api_key_id), session_id)
    calls = await session_calls(redis, str(owner.api_key_id), session_id)
    for _ in range(_WATCH_TRIES):
        async with redis.pipeline(transaction=True) as pipe:
            try:
                await pipe.watch(key)
                stored = await pipe.hgetall(key)
                decided = {
                    (name.decode() if isinstance(name, bytes) else name): orjson.loads(value)
                    for name, value in stored.items()
                }
                planned = plan(decision, decided, calls, exact=exact, skew_s=skew_s)
                if planned.recorded:
                    pipe.multi()
                    pipe.hset(
                        key,
                        mapping={
                            call: orjson.dumps(record) for call, record in planned.recorded.items()
                        },
                    )
                    pipe.expire(key, SESSION_CALLS_TTL_S)
                    await pipe.execute()
                return planned
            except WatchError:
                continue
    raise WatchError(f"decisions of session {session_id!r} kept changing")


def _counted(signal: Signal, joined: Joined) -> Joined:
    OTLP_RECORDS.labels(signal, joined.outcome).inc()
    return joined


def count_unused(signal: Signal, *, ignored: int, unjoinable: int) -> None:
    """Count records that carry no edit decision, and decisions that name nothing to join."""
    if ignored:
        OTLP_RECORDS.labels(signal, "ignored").inc(ignored)
    if unjoinable:
        OTLP_RECORDS.labels(signal, "unjoinable").inc(unjoinable)
