"""Reward distillation: raw components from a completion and its feedback, versioned formulas.

Pure functions: the worker loads a completion and the feedback reported for it, distils
the components (stored raw, so history can be replayed under a new formula), decides
whether the reward is final, and computes it with a numbered `RewardWeights` version.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Literal
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from app.events import (
    CompletionEvent,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
)
from app.signals.followup import is_dissatisfied

Feedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd
FinalizeReason = Literal["horizon", "session_end", "timeout"]
"""horizon: a survival report at (or past) the horizon arrived; session_end: the session ended;
timeout: horizon + grace passed since acceptance, or since the completion if never accepted."""

HORIZON_TOLERANCE_S = 1.0
"""A survival report within this of the horizon is the horizon report (IDE timers drift)."""


class RewardComponents(BaseModel):
    """What one completion earned, before any formula: stored raw for replays."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    edit_requested: bool
    proposed_edit: bool
    accepted: bool | None
    """None: no accept or reject seen."""
    kept: float | None = Field(ge=0, le=1)
    """Share of the edit still present at the horizon; 0 when rejected or when an edit was
    requested and none proposed; None while not known."""
    survival_elapsed_s: float | None
    """Elapsed time of the survival report `kept` was read from."""
    dissatisfied: bool | None
    """From the first follow-up; None when there was none."""
    latency_ms: float
    latency_over_budget: bool
    malformed_tool_calls: int = Field(ge=0)
    status: Literal["ok", "error"]


class RewardWeights(BaseModel):
    """One reward formula: kept share minus penalties (each penalty is subtracted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kept_weight: float = Field(ge=0)
    dissatisfied_penalty: float = Field(ge=0)
    latency_penalty: float = Field(ge=0)
    malformed_tool_call_penalty: float = Field(gt=0)
    """Strictly positive: a malformed tool call is always an explicit negative."""
    error_penalty: float = Field(ge=0)


REWARD_VERSIONS: dict[int, RewardWeights] = {
    1: RewardWeights(
        kept_weight=1.0,
        dissatisfied_penalty=0.5,
        latency_penalty=0.2,
        malformed_tool_call_penalty=1.0,
        error_penalty=0.5,
    ),
}
LATEST_REWARD_VERSION = max(REWARD_VERSIONS)


def _feedback_for(completion: CompletionEvent, feedback: Iterable[Feedback]) -> list[Feedback]:
    """This completion's feedback, once per event_id, in a canonical order.

    A session ends once for all its requests, so `session_end` matches on the session;
    every other signal matches on the request.
    """
    unique: dict[UUID, Feedback] = {}
    for event in feedback:
        if isinstance(event, SessionEnd):
            if event.session_id != completion.session_id:
                continue
        elif event.request_id != completion.request_id:
            continue
        unique.setdefault(event.event_id, event)
    return sorted(unique.values(), key=lambda event: (event.occurred_at, str(event.event_id)))


def _survival_at_horizon(reports: Sequence[EditSurvival], horizon_s: float) -> EditSurvival | None:
    """The horizon report, else the latest one before it; reports after the horizon don't count."""
    in_window = [r for r in reports if r.elapsed_s <= horizon_s + HORIZON_TOLERANCE_S]
    return max(in_window, key=lambda r: r.elapsed_s, default=None)


def distil_components(
    completion: CompletionEvent,
    feedback: Iterable[Feedback],
    *,
    horizon_s: float,
    latency_budget_ms: float,
) -> RewardComponents:
    """The reward components of a completion, whatever the order or duplication of its feedback."""
    events = _feedback_for(completion, feedback)
    # Any acceptance wins over a rejection: with multi-hunk edits a user accepts some hunks
    # and rejects others, and survival then measures what actually stayed.
    if any(isinstance(e, EditAccepted) for e in events):
        accepted: bool | None = True
    elif any(isinstance(e, EditRejected) for e in events):
        accepted = False
    else:
        accepted = None

    kept: float | None = None
    survival_elapsed_s: float | None = None
    if completion.edit_requested and not completion.proposed_edit:
        kept = 0.0  # no escaping blame by not writing code
    elif accepted is False:
        kept = 0.0
    else:
        reports = [e for e in events if isinstance(e, EditSurvival)]
        report = _survival_at_horizon(reports, horizon_s)
        if report is not None:
            kept, survival_elapsed_s = report.surviving_share, report.elapsed_s

    followups = [e for e in events if isinstance(e, FollowupMessage)]
    dissatisfied: bool | None = None
    if followups:
        first = followups[0]
        dissatisfied = (
            is_dissatisfied(first.message) if first.message is not None else first.dissatisfied
        )

    return RewardComponents(
        edit_requested=completion.edit_requested,
        proposed_edit=completion.proposed_edit,
        accepted=accepted,
        kept=kept,
        survival_elapsed_s=survival_elapsed_s,
        dissatisfied=dissatisfied,
        latency_ms=completion.latency_ms,
        latency_over_budget=completion.latency_ms > latency_budget_ms,
        malformed_tool_calls=completion.malformed_tool_calls,
        status=completion.status,
    )


def reward_due_at(
    completion: CompletionEvent,
    feedback: Iterable[Feedback],
    *,
    horizon_s: float,
    grace_s: float,
) -> datetime:
    """Horizon + grace after the first acceptance, or after the completion if never accepted."""
    events = _feedback_for(completion, feedback)
    acceptances = [e.occurred_at for e in events if isinstance(e, EditAccepted)]
    start = min(acceptances, default=completion.occurred_at)
    return start + timedelta(seconds=horizon_s + grace_s)


def finalize_reason(
    completion: CompletionEvent,
    feedback: Iterable[Feedback],
    *,
    horizon_s: float,
    grace_s: float,
    now: datetime,
) -> FinalizeReason | None:
    """Why the reward is final at `now` (see FinalizeReason), or None while it is still open."""
    events = _feedback_for(completion, feedback)
    if any(
        isinstance(e, EditSurvival) and e.elapsed_s >= horizon_s - HORIZON_TOLERANCE_S
        for e in events
    ):
        return "horizon"
    if any(isinstance(e, SessionEnd) for e in events):
        return "session_end"
    if now >= reward_due_at(completion, events, horizon_s=horizon_s, grace_s=grace_s):
        return "timeout"
    return None


def is_final(
    completion: CompletionEvent,
    feedback: Iterable[Feedback],
    *,
    horizon_s: float,
    grace_s: float,
    now: datetime,
) -> bool:
    """Whether the reward of the completion can be finalized at `now`."""
    reason = finalize_reason(completion, feedback, horizon_s=horizon_s, grace_s=grace_s, now=now)
    return reason is not None


def reward_weights(version: int) -> RewardWeights:
    """The weights of a reward formula version; raises ValueError for an unknown one."""
    try:
        return REWARD_VERSIONS[version]
    except KeyError:
        known = ", ".join(str(v) for v in sorted(REWARD_VERSIONS))
        raise ValueError(f"unknown reward version {version}; known versions: {known}") from None


def compute_reward(components: RewardComponents, version: int) -> float:
    """The scalar reward of final components under a formula version; unknown kept counts 0."""
    weights = reward_weights(version)
    kept = components.kept if components.kept is not None else 0.0
    return (
        weights.kept_weight * kept
        - weights.dissatisfied_penalty * bool(components.dissatisfied)
        - weights.latency_penalty * components.latency_over_budget
        - weights.malformed_tool_call_penalty * (components.malformed_tool_calls > 0)
        - weights.error_penalty * (components.status == "error")
    )
