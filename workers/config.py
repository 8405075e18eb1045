"""The worker's knobs: topics, batching, consumer-group timing, reward and sweep settings."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from app.config import Settings
from app.events import COMPLETIONS_TOPIC, DLQ_TOPIC, FEEDBACK_TOPIC
from app.signals.rewards import FEEDBACK_CLOCK_SKEW_S, LATEST_REWARD_VERSION, MAX_ACCEPT_DELAY_S


@dataclass(frozen=True)
class WorkerConfig:
    """Everything `run_worker` needs besides the service URLs."""

    completions_topic: str = COMPLETIONS_TOPIC
    """Topic of `CompletionEvent`s."""
    feedback_topic: str = FEEDBACK_TOPIC
    """Topic of IDE feedback events; must have as many partitions as the completions topic."""
    dlq_topic: str = DLQ_TOPIC
    """Where undecodable or invalid messages go, with the reason."""
    group_id: str = "rtrl-workers"
    """Kafka consumer group shared by every worker process."""
    max_records: int = 2000
    """Most messages one poll returns: one batch, one DB transaction, one offset commit."""
    statement_timeout_s: float = 30.0
    """The time budget of each statement that stores a batch (Postgres `statement_timeout`;
    waiting for a peer's partition lock does not count, nor does a wait for a row another
    transaction holds). A batch that overruns it is stored in halves; a message that
    overruns it alone goes to the DLQ."""
    lock_timeout_s: float = 5.0
    """How long a statement storing a batch waits for a lock another transaction holds (an
    erasure, partition maintenance, an export) before it gives up (Postgres `lock_timeout`).
    The whole batch is then stored again after a pause, backing off to 10 s, until the lock
    is free: a lock wait never splits a batch nor sends a message to the DLQ."""
    poll_timeout_ms: int = 500
    """How long a poll waits for messages when none are buffered."""
    session_timeout_ms: int = 6000
    """A worker that stops heartbeating for this long loses its partitions."""
    heartbeat_interval_ms: int = 1000
    """Heartbeats to the group coordinator; a third of the session timeout or less."""
    reward_version: int = LATEST_REWARD_VERSION
    """The formula (`app.signals.rewards.REWARD_VERSIONS`) that new rewards are computed with."""
    latency_budget_ms: float = 2000.0
    """End-to-end latency budget (formula 1's penalty; an A/B metric)."""
    ttft_budget_ms: float = 1000.0
    """Time-to-first-token budget."""
    tpot_budget_ms: float = 100.0
    """Time-per-output-token budget."""
    survival_horizon: timedelta = timedelta(minutes=15)
    """Edit survival is read at this time after acceptance."""
    finalization_grace: timedelta = timedelta(minutes=2)
    """Extra wait after the horizon for late survival reports before the sweep finalizes."""
    reopen_window: timedelta = timedelta(hours=1)
    """Evidence this long after finalization still re-opens a reward; later, it is counted."""
    max_accept_delay: timedelta = timedelta(seconds=MAX_ACCEPT_DELAY_S)
    """The latest acceptance after its completion that still earns a survival horizon; the
    reward is due by this plus the horizon and the grace, whatever the client's times say."""
    feedback_clock_skew: timedelta = timedelta(seconds=FEEDBACK_CLOCK_SKEW_S)
    """How far past its receipt at a gateway an event's own time may lie."""
    sweep_interval_s: float | None = 30.0
    """Seconds between finalization sweeps inside the worker loop; None: never."""
    monitor_interval_s: float | None = 60.0
    """Seconds between reward-hacking monitor checks inside the worker loop; None: never."""
    monitor_window: timedelta = timedelta(hours=1)
    """The monitors compare canary and control over this trailing window."""
    guardrail_interval_s: float | None = None
    """Seconds between guardrail checks that roll back harmful canaries; None: never."""
    topic_check_interval_s: float | None = 5.0
    """Seconds between checks that the topics read are the logs they were
    (`workers.recreated_topics`: a re-created topic is read again from its start); None: never."""

    @property
    def horizon_s(self) -> float:
        return self.survival_horizon.total_seconds()

    @property
    def grace_s(self) -> float:
        return self.finalization_grace.total_seconds()

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> WorkerConfig:
        """Defaults, the reward settings from `RTRL_*`, then `overrides` by field name."""
        configured = cls(
            survival_horizon=settings.survival_horizon,
            reward_version=settings.reward_version,
            latency_budget_ms=settings.latency_budget_ms,
            ttft_budget_ms=settings.ttft_budget_ms,
            tpot_budget_ms=settings.tpot_budget_ms,
            finalization_grace=settings.reward_grace,
            reopen_window=settings.reward_reopen_window,
            max_accept_delay=settings.reward_max_accept_delay,
            feedback_clock_skew=settings.feedback_clock_skew,
            guardrail_interval_s=(
                settings.guardrail_interval.total_seconds() if settings.guardrail_interval else None
            ),
        )
        return dataclasses.replace(configured, **overrides)
