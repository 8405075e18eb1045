"""Storing a batch: events become rows, and every reward new evidence touches is distilled again.

A redelivered event changes nothing. New evidence for a reward that is already final re-opens
it within `reopen_window` of its finalization (recomputed, counted in `reopen_count`); later
evidence is stored and counted in `late_evidence_count`, and the reward stands.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from typing import Any, cast

from prometheus_client import Counter
from sqlalchemy import Connection, Row

from app.events import (
    CompletionEvent,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
)
from app.history.erasure import hold_off_erasure, without_erased
from app.signals.followup import is_dissatisfied
from app.signals.rewards import (
    Feedback,
    RewardComponents,
    Served,
    Signal,
    compute_reward,
    distil_components,
    evidence_for,
    finalize_reason,
    reward_due_at,
    reward_weights,
    run_rewards,
)
from workers.config import WorkerConfig
from workers.repository import (
    count_late_evidence,
    insert_feedback,
    insert_samples,
    load_feedback_signals,
    load_runs,
    load_touched_samples,
    reopen_rewards,
    scrub_private_followups,
    set_rewards,
    upsert_rewards,
)

SURVIVAL_REPORTS_IGNORED = Counter(
    "rtrl_survival_reports_ignored_total",
    "Survival reports distillation left out because they claimed more time since the "
    "acceptance than had passed when a gateway received them (counted once per report).",
)


def clock_skew_s(config: WorkerConfig) -> float:
    """How far past its receipt an event's own time may lie (`feedback_clock_skew`)."""
    return config.feedback_clock_skew.total_seconds()


def max_accept_delay_s(config: WorkerConfig) -> float:
    """The latest acceptance that still earns a full survival horizon (`max_accept_delay`)."""
    return config.max_accept_delay.total_seconds()


def sample_row(event: CompletionEvent) -> dict[str, Any]:
    """The `samples` row of a completion; privacy-mode samples are metrics only, never trained."""
    private = event.privacy
    return {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "session_id": event.session_id,
        "user_hash": event.user_hash,
        "api_key_id": event.api_key_id,
        "checkpoint": event.checkpoint,
        "experiment_id": event.experiment_id,
        "arm": event.arm,
        "fallback": event.fallback,
        "privacy": private,
        "trainable": not private
        and event.status == "ok"
        and event.completion_token_ids is not None
        and untruncated_sampling(event)
        and not event.sampling_constraints
        and event.side_request is None,
        "edit_requested": event.edit_requested,
        "tools_declared": event.tools_declared,
        "side_request": event.side_request,
        "proposed_edit": event.proposed_edit,
        "clarifying_question": event.clarifying_question,
        "prompt_messages": None if private else without_nul(event.prompt_messages),
        "prompt_token_ids": None if private else event.prompt_token_ids,
        "completion_token_ids": None if private else event.completion_token_ids,
        "behaviour_logprobs": None if private else event.behaviour_logprobs,
        "completion_text": None if private else without_nul(event.completion_text),
        "completion_chars": event.completion_chars,
        "finish_reason": event.finish_reason,
        "status": event.status,
        "ttft_ms": event.ttft_ms,
        "ttft_measured": event.ttft_measured,
        "latency_ms": event.latency_ms,
        "completion_tokens": event.completion_tokens,
        "kafka_partition": None,
        "trajectory_id": event.trajectory_id,
        "turn_index": event.turn_index,
        "parent_request_id": event.parent_request_id,
        "token_prefix_match": event.token_prefix_match,
        "temperature": event.temperature,
        "top_p": event.top_p,
        "top_k": event.top_k,
        "max_tokens": event.max_tokens,
        "tool_calls": event.tool_calls,
        "malformed_tool_calls": event.malformed_tool_calls,
        "served_at": event.occurred_at,
    }


def untruncated_sampling(event: CompletionEvent) -> bool:
    """Whether the trainer can recompute the probabilities the tokens were sampled with.

    The trainer applies the logged temperature; top-p and top-k cut the distribution in ways
    it does not reproduce, and greedy decoding (temperature 0) is no distribution at all.
    """
    return event.temperature > 0 and event.top_p >= 1.0 and event.top_k in (-1, 0)


def without_nul(value: Any) -> Any:
    """`value` with each NUL character replaced by U+FFFD: Postgres text and JSONB cannot hold
    NUL, and a model's answer or a developer's paste may carry one; the record must not be
    lost over it."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [without_nul(item) for item in value]
    if isinstance(value, dict):
        return {without_nul(key): without_nul(item) for key, item in value.items()}
    return value


def feedback_row(event: Feedback) -> dict[str, Any]:
    """The `feedback_events` row of an IDE signal; a follow-up carries its dissatisfied verdict."""
    row: dict[str, Any] = {
        "event_id": event.event_id,
        "request_id": event.request_id,
        "session_id": event.session_id,
        "kind": event.kind,
        "elapsed_s": None,
        "surviving_share": None,
        "message": None,
        "dissatisfied": None,
        "occurred_at": event.occurred_at,
        "api_key_id": event.api_key_id if isinstance(event, SessionEnd) else None,
        # An event from before gateways stamped their receipt is taken as received when it
        # says it occurred, as it always was.
        "received_at": event.received_at or event.occurred_at,
        "source": event.source,
    }
    if isinstance(event, EditSurvival):
        row["elapsed_s"] = event.elapsed_s
        row["surviving_share"] = event.surviving_share
    elif isinstance(event, FollowupMessage):
        # Same precedence as `distil_components`: the text, when there is one, decides.
        row["message"] = without_nul(event.message)
        row["dissatisfied"] = (
            is_dissatisfied(event.message) if event.message is not None else event.dissatisfied
        )
    return row


def store_events(
    conn: Connection,
    sample_rows: Sequence[dict[str, Any]],
    feedback_rows: Sequence[dict[str, Any]],
    config: WorkerConfig,
    *,
    now: datetime,
) -> int:
    """Write a batch's samples and feedback, then refresh every reward the new ones touch.

    Events of erased users (still in Kafka, redelivered) are skipped, never stored again.
    """
    hold_off_erasure(conn)
    sample_rows, feedback_rows = without_erased(conn, sample_rows, feedback_rows)
    new_requests = insert_samples(conn, sample_rows)
    new_feedback = insert_feedback(conn, feedback_rows)
    scrub_private_followups(
        conn,
        {row["session_id"] for row in sample_rows if row["privacy"]}
        | {row["session_id"] for row in feedback_rows if row["message"] is not None},
    )
    # A session's end can only finalize: it never changes a final reward's components.
    evidence = {row.request_id for row in new_feedback if row.kind != "session_end"}
    touched = load_touched_samples(
        conn,
        request_ids=new_requests | evidence,
        ended_sessions={row.session_id for row in new_feedback if row.kind == "session_end"},
    )
    if not touched:
        return 0
    feedback = feedback_by_sample(conn, touched)
    still_open = [sample for sample in touched if sample.finalized_at is None]
    refreshed = [reward_row(sample, feedback[sample.id], config, now=now) for sample in still_open]
    changed_open = [
        row for row, sample in zip(refreshed, still_open, strict=True) if _changed(row, sample)
    ]
    count_ignored_reports(changed_open, still_open)
    upsert_rewards(conn, changed_open)
    final = [s for s in touched if s.finalized_at is not None and s.request_id in evidence]
    changed = len(changed_open) + reconsider_final_rewards(conn, final, feedback, config, now=now)
    credit_runs(conn, {s.trajectory_id for s in touched if s.trajectory_id}, config.reward_version)
    return changed


def count_ignored_reports(rows: Sequence[dict[str, Any]], samples: Sequence[Row[Any]]) -> None:
    """Count the survival reports these refreshed rewards leave out that their stored state
    did not: each report once, whichever batch first left it out."""
    stored = {sample.id: (sample.components or {}) for sample in samples}
    new = sum(
        max(
            0,
            row["components"]["survival_reports_ignored"]
            - stored[row["sample_id"]].get("survival_reports_ignored", 0),
        )
        for row in rows
    )
    if new:
        SURVIVAL_REPORTS_IGNORED.inc(new)


def _changed(row: dict[str, Any], sample: Row[Any]) -> bool:
    """Whether a refreshed open reward differs from the one stored (or none is stored yet)."""
    return (row["components"], row["finalize_reason"], row["due_at"], row["reward_version"]) != (
        sample.components,
        sample.finalize_reason,
        sample.due_at,
        sample.reward_version,
    )


def credit_runs(conn: Connection, trajectory_ids: Collection[str], version: int) -> None:
    """Give the final turns of these agent runs their share of the run's outcome.

    Under a formula with a turn discount a turn's reward depends on the turns after it, so
    it is set again whenever one of them is finalized (see `run_rewards`); under the others
    each turn keeps the reward it was finalized with.
    """
    if reward_weights(version).turn_discount is None:
        return
    runs: dict[str, list[Row[Any]]] = defaultdict(list)
    for turn in load_runs(conn, trajectory_ids):
        runs[turn.trajectory_id].append(turn)
    changed: dict[int, float | None] = {}
    for turns in runs.values():
        if len(turns) < 2:
            continue
        credited = run_rewards(
            [RewardComponents.model_validate(turn.components) for turn in turns],
            version,
        )
        for turn, reward in zip(turns, credited, strict=True):
            if turn.finalized_at is not None and turn.reward != reward:
                changed[turn.sample_id] = reward
    set_rewards(conn, changed, version)


def refresh_rewards(
    conn: Connection,
    sample_rows: Sequence[Row[Any]],
    config: WorkerConfig,
    *,
    now: datetime,
    sweeping: bool = False,
) -> int:
    """Re-distil the rewards of open samples from all their feedback; finalize the final ones.

    The stream finalizes on what it sees (the horizon report, the session's end); finalizing
    on time alone is the sweep's, since a lagging stream has not delivered the feedback yet.
    """
    if not sample_rows:
        return 0
    feedback = feedback_by_sample(conn, sample_rows)
    rows = [
        reward_row(sample, feedback[sample.id], config, now=now, sweeping=sweeping)
        for sample in sample_rows
    ]
    upsert_rewards(conn, rows)
    return len(rows)


def reconsider_final_rewards(
    conn: Connection,
    final_samples: Sequence[Row[Any]],
    feedback: Mapping[int, Sequence[Signal]],
    config: WorkerConfig,
    *,
    now: datetime,
) -> int:
    """Apply new evidence to final rewards within the reopen window; count what came later."""
    if not final_samples:
        return 0
    reopened, late = [], []
    for sample in final_samples:
        if now - sample.finalized_at > config.reopen_window:
            late.append(sample.id)
            continue
        row = reward_row(sample, feedback[sample.id], config, now=now)
        if (row["components"], row["finalize_reason"]) != (
            sample.components,
            sample.finalize_reason,
        ):
            reopened.append(row)
    count_ignored_reports(reopened, final_samples)
    reopen_rewards(conn, reopened)
    count_late_evidence(conn, late)
    return len(reopened)


def reward_row(
    sample: Row[Any],
    events: Sequence[Signal],
    config: WorkerConfig,
    *,
    now: datetime,
    sweeping: bool = False,
) -> dict[str, Any]:
    """The reward record of a sample given all its feedback, final or still open at `now`."""
    # The sample's row carries what distillation reads of its completion (`Served`).
    completion: Served = sample
    events = evidence_for(completion, events, clock_skew_s=clock_skew_s(config))
    components = distil_components(
        completion,
        events,
        horizon_s=config.horizon_s,
        latency_budget_ms=config.latency_budget_ms,
        ttft_budget_ms=config.ttft_budget_ms,
        tpot_budget_ms=config.tpot_budget_ms,
    )
    delay_s = max_accept_delay_s(config)
    # The stream finalizes on what it sees; finalizing on time alone is the sweep's.
    reason = finalize_reason(
        completion,
        events,
        horizon_s=config.horizon_s,
        grace_s=config.grace_s,
        now=now if sweeping else None,
        max_accept_delay_s=delay_s,
    )
    return {
        "sample_id": sample.id,
        "served_at": sample.served_at,
        "components": components.model_dump(mode="json"),
        "reward": compute_reward(components, config.reward_version) if reason else None,
        "reward_version": config.reward_version,
        "due_at": reward_due_at(
            completion,
            events,
            horizon_s=config.horizon_s,
            grace_s=config.grace_s,
            max_accept_delay_s=delay_s,
        ),
        "finalized_at": now if reason else None,
        "finalize_reason": reason,
    }


def feedback_by_sample(
    conn: Connection, sample_rows: Sequence[Row[Any]]
) -> dict[int, list[Signal]]:
    """Every feedback event of each sample (its request's, and its session's end), by sample id."""
    by_request: dict[str, list[Signal]] = defaultdict(list)
    ends_by_session: dict[str, list[Signal]] = defaultdict(list)
    signals = load_feedback_signals(
        conn, [s.request_id for s in sample_rows], {s.session_id for s in sample_rows}
    )
    for row in signals:
        if row.kind == "session_end":
            ends_by_session[row.session_id].append(_signal_of(row))
        else:
            by_request[row.request_id].append(_signal_of(row))
    return {
        s.id: by_request.get(s.request_id, []) + ends_by_session.get(s.session_id, [])
        for s in sample_rows
    }


def _signal_of(row: Row[Any]) -> Signal:
    # `FEEDBACK_SIGNAL_COLUMNS` are in the order of Signal's fields.
    return Signal(*cast(Sequence[Any], row))
