"""Finalization sweep and reward recompute, against Postgres in a rolled-back transaction."""

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kafka import TopicPartition
from sqlalchemy import Connection, select

from app.signals.rewards import REWARD_VERSIONS, RewardWeights, reward_weights
from workers.config import WorkerConfig
from workers.repository import rewards, samples
from workers.store import feedback_row, sample_row, store_events
from workers.sweep import finalize_due_rewards, recompute_rewards
from workers.watermarks import StreamWatermarks

CONFIG = WorkerConfig()


def rewards_of(conn: Connection, prefix: str) -> dict[str, Any]:
    rows = conn.execute(
        select(samples.c.request_id, rewards)
        .join(samples, samples.c.id == rewards.c.sample_id)
        .where(samples.c.request_id.startswith(prefix))
    )
    return {row.request_id: row for row in rows}


def seed(conn: Connection, events: Any) -> None:
    """r1: accepted, kept 0.5 at 2 min; r2: never accepted; r3: kept fully at the horizon."""
    completions = [events.completion(n) for n in (1, 2, 3)]
    feedback = [
        events.accepted(1),
        events.survival(1, 120, 0.5),
        events.accepted(3),
        events.survival(3, CONFIG.horizon_s, 1.0),
    ]
    store_events(
        conn,
        [sample_row(e) for e in completions],
        [feedback_row(e) for e in feedback],
        CONFIG,
        now=events.served_at,
    )


def test_sweep_finalizes_rewards_once_they_are_due(conn: Connection, events: Any) -> None:
    seed(conn, events)
    due_r2 = events.served_at + CONFIG.survival_horizon + CONFIG.finalization_grace
    due_r1 = due_r2 + timedelta(seconds=5)  # counted from the acceptance

    finalize_due_rewards(conn, CONFIG, now=due_r2 - timedelta(seconds=1))
    assert [r.finalize_reason for r in rewards_of(conn, events.prefix).values()].count(None) == 2

    finalize_due_rewards(conn, CONFIG, now=due_r2)
    found = rewards_of(conn, events.prefix)
    assert found[events.request(2)].finalize_reason == "timeout"
    assert found[events.request(2)].finalized_at == due_r2
    # An edit whose fate was never reported is censored, not zero: its kept share stays
    # unknown, and the reward takes the formula's prior in its place (none before formula 6).
    assert found[events.request(2)].components["kept"] is None
    assert found[events.request(2)].reward == reward_weights(CONFIG.reward_version).censored_kept
    assert found[events.request(1)].finalized_at is None
    assert found[events.request(3)].finalize_reason == "horizon"  # finalized by the stream

    finalize_due_rewards(conn, CONFIG, now=due_r1)
    found = rewards_of(conn, events.prefix)
    assert found[events.request(1)].finalize_reason == "timeout"
    assert found[events.request(1)].reward == 0.5
    assert found[events.request(1)].components["kept"] == 0.5


def test_recompute_replays_another_formula_over_final_rewards(
    conn: Connection, events: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    seed(conn, events)
    finalize_due_rewards(conn, CONFIG, now=datetime.now(UTC) + timedelta(days=1))
    before = rewards_of(conn, events.prefix)
    assert {r.reward_version for r in before.values()} == {CONFIG.reward_version}
    replayed = max(REWARD_VERSIONS) + 1
    monkeypatch.setitem(
        REWARD_VERSIONS,
        replayed,
        RewardWeights(
            kept_weight=2.0,
            dissatisfied_penalty=0.5,
            latency_penalty=0.2,
            malformed_tool_call_penalty=1.0,
            error_penalty=0.5,
        ),
    )

    assert recompute_rewards(conn, replayed) >= 3

    after = rewards_of(conn, events.prefix)
    assert {r.reward_version for r in after.values()} == {replayed}
    assert {request: r.reward for request, r in after.items()} == {
        events.request(1): 1.0,
        events.request(2): None,
        events.request(3): 2.0,
    }
    assert all(after[k].components == before[k].components for k in before)


def test_recompute_refuses_an_unknown_version(conn: Connection) -> None:
    with pytest.raises(ValueError, match="unknown reward version 99"):
        recompute_rewards(conn, 99)


def test_a_worker_sweeps_only_its_partitions_each_up_to_its_own_watermark(
    conn: Connection, events: Any
) -> None:
    rows = []
    for n, partition in ((1, 0), (2, 1), (3, 2)):
        row = sample_row(events.completion(n))
        rows.append(row | {"kafka_partition": partition})
    store_events(conn, rows, [], CONFIG, now=events.served_at)
    due = events.served_at + CONFIG.survival_horizon + CONFIG.finalization_grace

    # Partition 0 has been read past the due time; partition 1 only up to before it (a
    # backlog); partition 2 belongs to another worker.
    watermarks = {0: due + timedelta(seconds=1), 1: due - timedelta(minutes=5)}
    finalize_due_rewards(conn, CONFIG, now=due + timedelta(hours=1), watermarks=watermarks)

    found = rewards_of(conn, events.prefix)
    assert found[events.request(1)].finalize_reason == "timeout"
    assert found[events.request(2)].finalized_at is None
    assert found[events.request(3)].finalized_at is None


def test_a_partitions_watermark_is_now_when_read_to_the_end_else_its_last_message() -> None:
    class Record:
        def __init__(self, at: datetime) -> None:
            self.timestamp = int(at.timestamp() * 1000)

    class Consumer:
        """Offsets as a KafkaConsumer reports them: partition 0 read to the end, 1 behind."""

        def __init__(self) -> None:
            self.ends = {0: 10, 1: 50}

        def assignment(self) -> set[TopicPartition]:
            return {TopicPartition(t, p) for t in ("c", "f") for p in (0, 1)}

        def highwater(self, partition: TopicPartition) -> int:
            return self.ends[partition.partition]

        def position(self, partition: TopicPartition) -> int:
            return 10

    now = datetime(2026, 11, 30, 12, tzinfo=UTC)
    marks = StreamWatermarks()
    marks.observe({TopicPartition("c", 1): [Record(now - timedelta(minutes=3))]})
    marks.observe({TopicPartition("f", 1): [Record(now - timedelta(minutes=7))]})
    assert marks.by_partition(Consumer(), ("c", "f"), now) == {
        0: now,
        1: now - timedelta(minutes=7),
    }
    assert marks.by_partition(Consumer(), ("c", "f", "other"), now) == {}
