"""Reward distillation: raw components from a completion and its feedback, versioned formulas.

Pure functions: the worker loads a completion and the feedback reported for it, distils
the components (stored raw, so history can be replayed under a new formula), decides
whether the reward is final, and computes it with a numbered `RewardWeights` version.

Every decision here is a function of the *set* of events, never of their arrival order:
finality comes from evidence (the horizon report; a session that ended with nothing left to
report) or from event time (horizon + grace after acceptance), so the worker reaches the
same record whichever event it saw first.

An event's own time (`occurred_at`) is the client's to set, so it is read only within
`[served_at, received_at + clock skew]`: the completion was served before anything happened
to it, and nothing happened after the gateway received the event. A survival report that
claims more time since the acceptance than had passed when the gateway received it is left
out (and counted), and a reward is due no later than `reward_open_limit` after its
completion, however late the acceptance says it came.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Literal, Protocol
from uuid import UUID

from pydantic import BaseModel, ConfigDict, Field

from app.events import (
    CompletionStatus,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
)
from app.signals.followup import is_dissatisfied

Feedback = EditAccepted | EditRejected | EditSurvival | FollowupMessage | SessionEnd
FinalizeReason = Literal["horizon", "censored", "session_end", "timeout"]
"""horizon: a survival report at (or past) the horizon arrived; censored: the IDE said it will
observe no more windows (it closed), or the acceptance came more than the max accept delay
after the completion and the reward's time bound passed (`reward_open_limit`); session_end:
the session ended and nothing more can be reported (no edit accepted); timeout: horizon +
grace passed since acceptance, or since the completion if never accepted."""

HORIZON_TOLERANCE_S = 1.0
"""A survival report within this of the horizon is the horizon report (IDE timers drift)."""

FEEDBACK_CLOCK_SKEW_S = 60.0
"""How far past the gateway's receipt an event's own time may lie (IDE clocks drift)."""

MAX_ACCEPT_DELAY_S = 3600.0
"""Longest wait between a completion and its acceptance that still earns a full survival
horizon; a later acceptance's reward is finalized (censored) at the bound."""


def reward_open_limit(
    *, horizon_s: float, grace_s: float, max_accept_delay_s: float = MAX_ACCEPT_DELAY_S
) -> timedelta:
    """The longest a reward stays open after its completion was served: the latest
    acceptance that counts, the survival horizon, and the grace for late reports."""
    return timedelta(seconds=max_accept_delay_s + horizon_s + grace_s)


REWARD_OPEN_LIMIT = reward_open_limit(horizon_s=15 * 60, grace_s=2 * 60)
"""`reward_open_limit` with the default survival horizon (15 min) and grace (2 min)."""


class RewardComponents(BaseModel):
    """What one completion earned, before any formula: stored raw for replays."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    edit_requested: bool
    proposed_edit: bool
    accepted: bool | None
    """None: no accept or reject seen."""
    kept: float | None = Field(ge=0, le=1)
    """Share of the edit still present at the last window reported up to the horizon (an
    acceptance is the window at 0 s, where all of it is present); 0 when rejected or when an
    edit was requested and none proposed; None when no verdict was given."""
    survival_elapsed_s: float | None
    """The window `kept` was read from: the horizon, an earlier one when the later windows
    were never reported (censored: missing, not 0), 0 for the acceptance itself."""
    dissatisfied: bool | None
    """From the first follow-up; None when there was none."""
    latency_ms: float
    latency_over_budget: bool
    """End to end: an A/B metric, and formula 1's penalty (which also punished long answers)."""
    malformed_tool_calls: int = Field(ge=0)
    status: CompletionStatus
    ttft_ms: float | None = None
    """Time to first token."""
    tpot_ms: float | None = None
    """Time per output token after the first; None with fewer than two tokens."""
    ttft_over_budget: bool = False
    tpot_over_budget: bool = False
    clarifying_question: bool = False
    """The answer asked a question instead of acting (no code, no tool call)."""
    survival_reports_ignored: int = Field(default=0, ge=0)
    """Survival reports left out: each claimed more time since the acceptance than had passed
    when the gateway received it."""

    @property
    def kept_unknown(self) -> bool:
        """An edit was proposed (or accepted) and its fate never reported: no reward can be
        computed from it."""
        return self.kept is None and (self.proposed_edit or self.accepted is True)


class RewardWeights(BaseModel):
    """One reward formula: kept share minus penalties (each penalty is subtracted)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kept_weight: float = Field(ge=0)
    dissatisfied_penalty: float = Field(ge=0)
    latency_penalty: float = Field(default=0.0, ge=0)
    """On end-to-end latency over budget."""
    ttft_penalty: float = Field(default=0.0, ge=0)
    """On time to first token over budget."""
    tpot_penalty: float = Field(default=0.0, ge=0)
    """On time per output token over budget: slow generation, not a long answer."""
    malformed_tool_call_penalty: float = Field(ge=0)
    """Positive in every formula but the flawed 0: a malformed call must cost something, or
    a policy learns to emit one where it expects to fail."""
    question_score: float | None = None
    """The flawed formula 0 only: the outcome of a turn that asked a clarifying question,
    instead of what the developer made of it. None: a question is judged like any answer
    (an edit was asked for and none proposed: kept 0)."""
    error_penalty: float = Field(ge=0)
    turn_discount: float | None = Field(default=None, gt=0, le=1)
    """Agent runs: a turn earns the outcome (kept share, follow-up verdict) of the next edit
    of its run, discounted per turn between them (AReaL's turn discount); None: each
    completion is judged alone."""
    after_last_edit: Literal["own", "shared"] = "own"
    """Agent runs: what the turns after a run's last edit (its final answer) earn — their
    own outcome, which blames an answer that reports a finished edit as "asked for an edit
    and proposed none", or the last edit's, discounted per turn after it."""
    followup_credit: Literal["own", "run"] = "own"
    """Agent runs: who pays for the developer's dissatisfied follow-up — the turn it was
    reported on (its edit), or every turn of the run, discounted per turn from it. A
    follow-up judges the run; charged to one turn, an edit the workspace refused (and the
    turns before it) escapes it, and a policy learns that an edit which cannot apply costs
    less than one that fails."""
    censored_kept: float | None = Field(default=None, ge=0, le=1)
    """What an edit whose fate was never seen counts as kept (its components keep `kept`
    None: censored, not a verdict). None: no reward — the turn, and in a run the turns whose
    credit comes from it, are left out of training. A number: the prior the reward takes in
    its place, neither a kept edit (1) nor a refused one (0), so that a client that reports
    nothing (the next request never came, the user left) still rewards the turn on what is
    known of it (its conduct, a follow-up). A policy that dodges evidence earns the prior
    whatever it would have shown: a prior above its seen edits' mean pays the dodging, so the
    `censored_edit_rate` metric watches for it."""


# Formula 2: latency from time to first token and per output token, so a long, correct edit
# is not punished for its length.
_FORMULA_2 = RewardWeights(
    kept_weight=1.0,
    dissatisfied_penalty=0.5,
    ttft_penalty=0.1,
    tpot_penalty=0.1,
    malformed_tool_call_penalty=1.0,
    error_penalty=0.5,
)
REWARD_VERSIONS: dict[int, RewardWeights] = {
    # The naive formula the reward-hacking scenario (`rtrl demo --scenario reward-hacking`)
    # starts from, kept so the two classic hacks can be reproduced: a malformed tool call
    # costs nothing, and a clarifying question "engages" the developer (0.5), scoring above
    # a failed edit (-0.5). Never the default; the monitors catch what it teaches.
    0: RewardWeights(
        kept_weight=1.0,
        dissatisfied_penalty=0.5,
        malformed_tool_call_penalty=0.0,
        error_penalty=0.5,
        question_score=0.5,
        turn_discount=0.9,
        after_last_edit="shared",
    ),
    1: RewardWeights(
        kept_weight=1.0,
        dissatisfied_penalty=0.5,
        latency_penalty=0.2,
        malformed_tool_call_penalty=1.0,
        error_penalty=0.5,
    ),
    2: _FORMULA_2,
    # Formula 2 with credit across an agent run's turns: the read and test turns that led to
    # a kept edit share in it instead of counting as rejections.
    3: _FORMULA_2.model_copy(update={"turn_discount": 0.9}),
    # Formula 3, and a run's final answer after its last edit shares that edit's outcome:
    # under 3 it scored 0 whatever became of the edit, which teaches an agent to keep
    # calling tools instead of finishing.
    4: _FORMULA_2.model_copy(update={"turn_discount": 0.9, "after_last_edit": "shared"}),
    # Formula 4, and the run's follow-up is charged to every turn of the run: under 4 an edit
    # the workspace could not apply (and the turns before it) scored 0, above an applied edit
    # that failed (-0.5), which rewards breaking an edit's old_string.
    5: _FORMULA_2.model_copy(
        update={"turn_discount": 0.9, "after_last_edit": "shared", "followup_credit": "run"}
    ),
    # Formula 5, and an edit whose fate was never seen is censored at a prior of 0.5 instead
    # of leaving its run without a reward: under 5, every run of a client that reports
    # nothing and whose conversation ended after an edit was left out of training, so
    # training saw only the runs whose fate was told — a reward missing by the action taken.
    6: _FORMULA_2.model_copy(
        update={
            "turn_discount": 0.9,
            "after_last_edit": "shared",
            "followup_credit": "run",
            "censored_kept": 0.5,
        }
    ),
}
LATEST_REWARD_VERSION = max(REWARD_VERSIONS)


@dataclass(frozen=True, slots=True)
class Signal:
    """One IDE signal as distillation reads it, whatever its kind: a decoded feedback event
    (`signal_of`) or a stored one, read straight from its row. Fields its kind lacks are None."""

    kind: str
    event_id: UUID
    request_id: str
    session_id: str
    occurred_at: datetime
    elapsed_s: float | None = None
    surviving_share: float | None = None
    censored: bool = False
    message: str | None = None
    dissatisfied: bool | None = None
    api_key_id: UUID | None = None
    received_at: datetime | None = None
    """When a gateway accepted it; None (events from before gateways stamped it): taken as
    received when it says it occurred."""


def signal_of(event: Feedback | Signal) -> Signal:
    """The signal a feedback event carries."""
    if isinstance(event, Signal):
        return event
    signal = Signal(
        event.kind,
        event.event_id,
        event.request_id,
        event.session_id,
        event.occurred_at,
        received_at=event.received_at,
    )
    if isinstance(event, EditSurvival):
        return replace(
            signal,
            elapsed_s=event.elapsed_s,
            surviving_share=event.surviving_share,
            censored=event.censored,
        )
    if isinstance(event, FollowupMessage):
        return replace(signal, message=event.message, dissatisfied=event.dissatisfied)
    if isinstance(event, SessionEnd):
        return replace(signal, api_key_id=event.api_key_id)
    return signal


class Served(Protocol):
    """What distillation reads of a served completion: its `CompletionEvent`, or its stored row."""

    @property
    def request_id(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    @property
    def api_key_id(self) -> UUID | None: ...
    @property
    def occurred_at(self) -> datetime: ...
    @property
    def edit_requested(self) -> bool: ...
    @property
    def proposed_edit(self) -> bool: ...
    @property
    def status(self) -> CompletionStatus: ...
    @property
    def ttft_ms(self) -> float: ...
    @property
    def ttft_measured(self) -> bool: ...
    @property
    def latency_ms(self) -> float: ...
    @property
    def completion_tokens(self) -> int | None: ...
    @property
    def malformed_tool_calls(self) -> int: ...
    @property
    def clarifying_question(self) -> bool: ...


class Evidence(list[Signal]):
    """One completion's feedback, deduplicated, its times bounded, in canonical order (see
    `evidence_for`)."""

    request_id: str = ""
    survival_reports_ignored: int = 0
    """Survival reports left out: measured, by their own account, after they were received."""


def evidence_for(
    completion: Served,
    feedback: Iterable[Feedback | Signal],
    *,
    clock_skew_s: float = FEEDBACK_CLOCK_SKEW_S,
) -> Evidence:
    """This completion's feedback, once per event_id, each at a time it can have happened,
    in a canonical order.

    A session ends once for all its requests, so `session_end` matches on the session;
    every other signal matches on the request. Each signal's `occurred_at` is read within
    `[served_at, received_at + clock_skew_s]`, and a survival report whose window could not
    have passed since the acceptance by the time it was received is left out. Evidence
    already gathered for the completion is returned as it is, so the functions below can
    share one gathering.
    """
    if isinstance(feedback, Evidence) and feedback.request_id == completion.request_id:
        return feedback
    unique: dict[UUID, Signal] = {}
    for event in feedback:
        signal = signal_of(event)
        if signal.kind == "session_end":
            if signal.session_id != completion.session_id or not _same_key(signal, completion):
                continue
        elif signal.request_id != completion.request_id:
            continue
        unique.setdefault(signal.event_id, signal)
    skew = timedelta(seconds=clock_skew_s)
    bounded = [_in_time(signal, completion.occurred_at, skew) for signal in unique.values()]
    accepted_at = min(
        (signal.occurred_at for signal in bounded if signal.kind == "edit_accepted"),
        default=completion.occurred_at,
    )
    plausible = [signal for signal in bounded if _measured_in_time(signal, accepted_at, skew)]
    evidence = Evidence(
        # UUIDs order as their text does (fixed-width lowercase hex), without formatting it.
        sorted(plausible, key=lambda signal: (signal.occurred_at, signal.event_id))
    )
    evidence.request_id = completion.request_id
    evidence.survival_reports_ignored = len(bounded) - len(plausible)
    return evidence


def _in_time(signal: Signal, served_at: datetime, skew: timedelta) -> Signal:
    """The signal at its own time moved into `[served_at, received_at + skew]`: nothing
    happens to a completion before it is served, nor after the gateway heard of it."""
    received = signal.received_at or signal.occurred_at
    occurred = max(served_at, min(signal.occurred_at, received + skew))
    return signal if occurred == signal.occurred_at else replace(signal, occurred_at=occurred)


def _measured_in_time(signal: Signal, accepted_at: datetime, skew: timedelta) -> bool:
    """False for a survival report whose window (`elapsed_s` after the acceptance) had not
    passed when the gateway received it: a share of an edit 900 s on, reported 1 s after the
    acceptance, was never measured."""
    if signal.kind != "edit_survival" or signal.censored or signal.elapsed_s is None:
        return True
    received = signal.received_at or signal.occurred_at
    return timedelta(seconds=signal.elapsed_s) <= received - accepted_at + skew


def _same_key(end: Signal, completion: Served) -> bool:
    """Whether a session's end is the completion's key's (unknown keys are let through)."""
    return end.api_key_id is None or completion.api_key_id in (None, end.api_key_id)


def acceptance(events: Iterable[Signal]) -> bool | None:
    """True when any hunk was accepted, False when only rejected, None when neither was seen.

    Any acceptance wins over a rejection: with multi-hunk edits a user accepts some hunks
    and rejects others, and survival then measures what actually stayed.
    """
    kinds = {signal.kind for signal in events}
    if "edit_accepted" in kinds:
        return True
    if "edit_rejected" in kinds:
        return False
    return None


def _survival_at_horizon(reports: Sequence[Signal], horizon_s: float) -> Signal | None:
    """The horizon report, else the latest measured one before it; reports after the horizon
    and censored windows (never observed) don't count."""
    in_window = [
        r
        for r in reports
        if r.elapsed_s is not None
        and not r.censored
        and r.elapsed_s <= horizon_s + HORIZON_TOLERANCE_S
    ]
    return max(in_window, key=lambda r: r.elapsed_s or 0.0, default=None)


def distil_components(
    completion: Served,
    feedback: Iterable[Feedback | Signal],
    *,
    horizon_s: float,
    latency_budget_ms: float,
    ttft_budget_ms: float = float("inf"),
    tpot_budget_ms: float = float("inf"),
) -> RewardComponents:
    """The reward components of a completion, whatever the order or duplication of its feedback."""
    events = evidence_for(completion, feedback)
    accepted = acceptance(events)

    kept: float | None = None
    survival_elapsed_s: float | None = None
    if completion.edit_requested and not completion.proposed_edit:
        kept = 0.0  # no escaping blame by not writing code
    elif accepted is False:
        kept = 0.0
    else:
        reports = [e for e in events if e.kind == "edit_survival"]
        report = _survival_at_horizon(reports, horizon_s)
        if report is not None:
            kept, survival_elapsed_s = report.surviving_share, report.elapsed_s
        elif accepted:
            # Clients that measure no survival (most do not) still report the acceptance: the
            # window at 0 s. Dropping these edits instead would leave a batch of rejections.
            kept, survival_elapsed_s = 1.0, 0.0

    followups = [e for e in events if e.kind == "followup_message"]
    dissatisfied: bool | None = None
    if followups:
        first = followups[0]
        dissatisfied = (
            is_dissatisfied(first.message) if first.message is not None else first.dissatisfied
        )

    tpot_ms = time_per_output_token(completion)
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
        ttft_ms=completion.ttft_ms,
        tpot_ms=tpot_ms,
        ttft_over_budget=completion.ttft_measured and completion.ttft_ms > ttft_budget_ms,
        tpot_over_budget=tpot_ms is not None and tpot_ms > tpot_budget_ms,
        clarifying_question=completion.clarifying_question,
        survival_reports_ignored=events.survival_reports_ignored,
    )


def time_per_output_token(completion: Served) -> float | None:
    """Generation time per token after the first; None when fewer than two were generated, or
    when the first token's time was not measured."""
    tokens = completion.completion_tokens
    if tokens is None or tokens < 2 or not completion.ttft_measured:
        return None
    return max(completion.latency_ms - completion.ttft_ms, 0.0) / (tokens - 1)


def reward_due_at(
    completion: Served,
    feedback: Iterable[Feedback | Signal],
    *,
    horizon_s: float,
    grace_s: float,
    max_accept_delay_s: float = MAX_ACCEPT_DELAY_S,
) -> datetime:
    """Horizon + grace after the first acceptance, or after the completion if never accepted;
    never later than `reward_open_limit` after the completion."""
    events = evidence_for(completion, feedback)
    return _accepted_from(completion, events, max_accept_delay_s) + timedelta(
        seconds=horizon_s + grace_s
    )


def _accepted_from(completion: Served, events: Evidence, max_accept_delay_s: float) -> datetime:
    """Where the survival horizon starts: the first acceptance (the completion when none),
    held to the max accept delay after the completion."""
    acceptances = [e.occurred_at for e in events if e.kind == "edit_accepted"]
    latest = completion.occurred_at + timedelta(seconds=max_accept_delay_s)
    return min(min(acceptances, default=completion.occurred_at), latest)


def _accepted_too_late(completion: Served, events: Evidence, max_accept_delay_s: float) -> bool:
    """Whether the first acceptance came after the max accept delay: its horizon was cut."""
    acceptances = [e.occurred_at for e in events if e.kind == "edit_accepted"]
    latest = completion.occurred_at + timedelta(seconds=max_accept_delay_s)
    return bool(acceptances) and min(acceptances) > latest


def finalize_reason(
    completion: Served,
    feedback: Iterable[Feedback | Signal],
    *,
    horizon_s: float,
    grace_s: float,
    now: datetime | None,
    max_accept_delay_s: float = MAX_ACCEPT_DELAY_S,
) -> FinalizeReason | None:
    """Why the reward is final at `now` (see FinalizeReason), or None while it is still open;
    with `now` None, only what the evidence itself finalizes (no time has run out).

    A session's end finalizes only what can receive no more evidence: an accepted edit still
    waits for its horizon report (or horizon + grace), however early the session ended.
    """
    events = evidence_for(completion, feedback)
    survival = [e for e in events if e.kind == "edit_survival"]
    if any(
        not e.censored
        and e.elapsed_s is not None
        and e.elapsed_s >= horizon_s - HORIZON_TOLERANCE_S
        for e in survival
    ):
        return "horizon"
    if any(e.censored for e in survival):
        return "censored"
    if any(e.kind == "session_end" for e in events) and acceptance(events) is not True:
        return "session_end"
    due = reward_due_at(
        completion,
        events,
        horizon_s=horizon_s,
        grace_s=grace_s,
        max_accept_delay_s=max_accept_delay_s,
    )
    if now is None or now < due:
        return None
    return "censored" if _accepted_too_late(completion, events, max_accept_delay_s) else "timeout"


def is_final(
    completion: Served,
    feedback: Iterable[Feedback | Signal],
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


def compute_reward(components: RewardComponents, version: int) -> float | None:
    """The scalar reward of final components under a formula version, judged alone.

    When an edit was proposed and its fate never reported, an unknown kept share is not a
    zero: None (the sample is left out of training), or under a formula with `censored_kept`
    that prior in its place. Either way the kept metric leaves it out.
    """
    weights = reward_weights(version)
    if components.kept_unknown and weights.censored_kept is None:
        return None
    return _outcome(components, weights) - _conduct(components, weights)


def run_rewards(turns: Sequence[RewardComponents], version: int) -> list[float | None]:
    """The rewards of an agent run's turns, in turn order, under a formula version.

    With a turn discount, a turn's outcome is that of the next turn at or after it that made
    an edit (kept share, follow-up verdict), discounted once per turn between them; turns
    after the last edit keep their own, or share the last edit's (`after_last_edit`). Each
    turn still pays for its own conduct (latency, malformed tool calls, errors). With
    `followup_credit` "run", the kept share comes from that edit but a dissatisfied follow-up
    is charged to every turn, discounted per turn from the one it was reported on. An edit
    whose fate is unknown leaves the turns that led to it without a reward too, unless the
    formula censors it (`censored_kept`): then they share the prior.
    """
    weights = reward_weights(version)
    if weights.turn_discount is None:
        return [compute_reward(turn, version) for turn in turns]
    rewards: list[float | None] = []
    edits = [k for k, turn in enumerate(turns) if _made_edit(turn)]
    followups = [k for k, turn in enumerate(turns) if turn.dissatisfied is not None]
    for index, turn in enumerate(turns):
        edit = next((k for k in edits if k >= index), index)
        if edit == index and not _made_edit(turn) and weights.after_last_edit == "shared":
            edit = max((k for k in edits if k < index), default=index)
        outcome_turn = turns[edit]
        if outcome_turn.kept_unknown and weights.censored_kept is None:
            rewards.append(None)
            continue
        discount = weights.turn_discount ** abs(edit - index)
        if weights.followup_credit == "own":
            rewards.append(discount * _outcome(outcome_turn, weights) - _conduct(turn, weights))
            continue
        # The follow-up nearest after this turn (else the last before it) judges the run.
        judged = next((k for k in followups if k >= index), max(followups, default=None))
        complaint = 0.0
        if judged is not None:
            complaint = (
                weights.turn_discount ** abs(judged - index)
                * weights.dissatisfied_penalty
                * bool(turns[judged].dissatisfied)
            )
        rewards.append(
            discount * _kept_outcome(outcome_turn, weights) - complaint - _conduct(turn, weights)
        )
    return rewards


def _made_edit(components: RewardComponents) -> bool:
    return components.proposed_edit or components.accepted is not None


def _outcome(components: RewardComponents, weights: RewardWeights) -> float:
    """What the developer made of the answer: kept share less a dissatisfied follow-up."""
    if weights.question_score is not None and components.clarifying_question:
        return weights.question_score
    return _kept_outcome(components, weights) - weights.dissatisfied_penalty * bool(
        components.dissatisfied
    )


def _kept_outcome(components: RewardComponents, weights: RewardWeights) -> float:
    kept = components.kept if components.kept is not None else 0.0
    if components.kept_unknown and weights.censored_kept is not None:
        kept = weights.censored_kept
    return weights.kept_weight * kept


def _conduct(components: RewardComponents, weights: RewardWeights) -> float:
    """The penalties for how the answer was served: latency, malformed calls, errors."""
    return (
        weights.latency_penalty * components.latency_over_budget
        + weights.ttft_penalty * components.ttft_over_budget
        + weights.tpot_penalty * components.tpot_over_budget
        + weights.malformed_tool_call_penalty * (components.malformed_tool_calls > 0)
        + weights.error_penalty * (components.status == "error")
    )
