"""Prometheus metrics of the reward workers: consumption, lag, finalization.

Served at RTRL_METRICS_PORT when it is set (`rtrl worker`); the reward-hacking monitors'
counter lives beside them in `workers.monitors`.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC

MESSAGES = Counter(
    "rtrl_worker_messages_total",
    "Messages carried through to committed offsets, by topic (dead letters included).",
    ["topic"],
)
DEAD_LETTERS = Counter(
    "rtrl_worker_dead_letters_total",
    "Messages sent to the dead-letter topic, by the topic they came from.",
    ["topic"],
)
LOCK_WAIT_RETRIES = Counter(
    "rtrl_worker_lock_wait_retries_total",
    "Batches stored again, whole, after a statement gave up waiting for a lock another "
    "transaction held (the worker's lock_timeout_s: an erasure, partition maintenance, an "
    "export); a rate that stays up means a transaction holds history tables for long.",
)
BATCH_SECONDS = Histogram(
    "rtrl_worker_batch_seconds",
    "Time from a poll's return to its committed offsets.",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
CONSUMER_LAG = Gauge(
    "rtrl_consumer_lag_messages",
    "Messages not yet read on the partitions this worker owns, by topic.",
    ["topic"],
)
TOPICS_RECREATED = Counter(
    "rtrl_worker_topics_recreated_total",
    "Topics this worker found re-created under a new topic id (the broker lost their log), "
    "whose partitions it then read again from the start.",
    ["topic"],
)
REWARDS_SWEPT = Counter(
    "rtrl_rewards_swept_total", "Open rewards the timed sweep finalized once they were due."
)
REWARDS_OVERDUE = Gauge(
    "rtrl_rewards_overdue_seconds",
    "How long past its due time the oldest open reward is (0 when none is overdue).",
)

for _topic in (COMPLETIONS_TOPIC, FEEDBACK_TOPIC):
    # Series exist from the start, so a rate or an increase sees the first message.
    MESSAGES.labels(_topic)
    DEAD_LETTERS.labels(_topic)
