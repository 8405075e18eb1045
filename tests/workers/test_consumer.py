"""The worker end to end: decoding as plain functions, then real Kafka and Postgres."""

import os
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import orjson
import pytest
from kafka import KafkaProducer
from prometheus_client import REGISTRY
from sqlalchemy import Engine, func, select

from app.config import get_settings
from app.db import PROJECT_ROOT
from app.events import CompletionEvent, encode
from app.processes import free_port
from app.signals.rewards import distil_components
from rtrl.embedded.kafka import EmbeddedKafka
from tests.workers.conftest import publisher, read_dead_letters
from workers.config import WorkerConfig
from workers.consumer import decode_batch
from workers.repository import feedback_events


class FakeRecord(NamedTuple):
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def test_undecodable_and_invalid_messages_become_dead_letters_with_reasons(events: Any) -> None:
    config = WorkerConfig(completions_topic="c", feedback_topic="f")
    good = events.completion(1)
    bad_schema = orjson.dumps({**orjson.loads(encode(good)), "ttft_ms": -1})
    private_with_text = orjson.dumps({**orjson.loads(encode(good)), "privacy": True})
    records = [
        FakeRecord("c", 0, 0, b"s", encode(good)),
        FakeRecord("c", 0, 1, b"s", b"\xff not json"),
        FakeRecord("c", 0, 2, b"s", bad_schema),
        FakeRecord("c", 0, 3, b"s", private_with_text),
        FakeRecord("c", 0, 4, b"s", encode(events.completion(2, checkpoint="x" * 100))),
        FakeRecord("f", 1, 7, None, encode(events.followup(1, "nul \x00 inside"))),
        FakeRecord("f", 1, 8, b"s", None),
        FakeRecord("f", 1, 9, b"s", encode(events.accepted(1))),
    ]

    batch = decode_batch(records, config)

    assert [a.row["request_id"] for a in batch.samples] == [events.request(1)]
    # A NUL in what a developer typed is stored as U+FFFD, not refused: the record counts.
    assert [(a.row["kind"], a.row["message"]) for a in batch.feedback] == [
        ("followup_message", "nul \ufffd inside"),
        ("edit_accepted", None),
    ]
    reasons = {(d.source_topic, d.offset): d.reason for d in batch.dead_letters}
    assert reasons.keys() == {("c", 1), ("c", 2), ("c", 3), ("c", 4), ("f", 8)}
    assert reasons["c", 1].startswith("undecodable: ")
    assert "ttft_ms" in reasons["c", 2]
    assert "privacy-mode completions carry no content" in reasons["c", 3]
    assert reasons["c", 4] == "invalid: checkpoint is longer than 64 characters"
    assert reasons["f", 8] == "empty message"
    letter = next(d for d in batch.dead_letters if d.offset == 1)
    assert letter.payload == "\ufffd not json"
    assert letter.key == "s"
    private = next(d for d in batch.dead_letters if d.offset == 3)
    assert orjson.loads(private.payload) == {
        "event_id": str(good.event_id),
        "session_id": good.session_id,
        "request_id": good.request_id,
        "privacy": True,
    }
    assert "privacy mode: content dropped" in private.reason
    assert good.completion_text not in private.reason


# --- against the real broker and Postgres -------------------------------------------------


class Scenario(NamedTuple):
    completions: list[CompletionEvent]
    feedback: list[Any]
    expected: dict[str, dict[str, Any]]
    """Components by request id, distilled from every event at once."""


def scenario(events: Any, config: WorkerConfig, count: int, first: int = 0) -> Scenario:
    """Completions of varied kinds with their feedback; some sessions end at the last event."""
    rng = random.Random(count + first)
    completions, feedback, endings = [], [], []
    for n in range(first, first + count):
        completion = events.completion(
            n,
            latency_ms=3000.0 if n % 7 == 0 else 400.0,
            tool_calls=1 if n % 5 == 0 else 0,
            malformed_tool_calls=1 if n % 10 == 0 else 0,
            proposed_edit=n % 11 != 0,
            **({"privacy": True} if n % 6 == 0 else {}),
        )
        completions.append(completion)
        if n % 4 == 0:
            feedback.append(events.rejected(n))
        else:
            feedback += [events.accepted(n), events.survival(n, 120, round(rng.random(), 2))]
        if n % 3 == 0:
            feedback.append(events.followup(n, rng.choice(["still broken", "thanks!"])))
        if n % 8 == 0:
            endings.append(events.session_end(n))
    feedback += endings  # last in their partition, so every other signal is in first
    expected = {
        c.request_id: distil_components(
            c, feedback, horizon_s=config.horizon_s, latency_budget_ms=config.latency_budget_ms
        ).model_dump(mode="json")
        for c in completions
    }
    return Scenario(completions, feedback, expected)


def send_shuffled(publish: Any, plan: Scenario, seed: int) -> None:
    """Every event twice, completions and feedback interleaved, endings after the rest."""
    rng = random.Random(seed)
    endings = [e for e in plan.feedback if e.kind == "session_end"]
    others = [e for e in plan.feedback if e.kind != "session_end"]
    stream = plan.completions + others + plan.completions + others
    rng.shuffle(stream)
    publish(*stream, *endings, *endings)


def settled(read_rewards: Any, prefix: str, plan: Scenario) -> bool:
    """Every reward has its components, and every ended session's rewards are final.

    The endings are sent last and leave the components alone, so components alone can match
    while the last endings are still in flight.
    """
    found = read_rewards(prefix)
    ended = {e.request_id for e in plan.feedback if e.kind == "session_end"}
    return {k: r.components for k, r in found.items()} == plan.expected and {
        k for k, r in found.items() if r.finalize_reason == "session_end"
    } == ended


def assert_exactly_once(worker_engine: Engine, read_rewards: Any, prefix: str, plan: Scenario):
    found = read_rewards(prefix)
    assert len(found) == len(plan.completions)
    assert {k: r.components for k, r in found.items()} == plan.expected
    ended = {e.request_id for e in plan.feedback if e.kind == "session_end"}
    assert {k for k, r in found.items() if r.finalize_reason == "session_end"} == ended
    with worker_engine.connect() as conn:
        stored = conn.scalar(
            select(func.count()).where(feedback_events.c.request_id.startswith(prefix))
        )
    assert stored == len(plan.feedback)


def test_duplicated_out_of_order_events_yield_one_reward_each(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_thread: Any,
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
) -> None:
    plan = scenario(events, worker_config, 60)
    send_shuffled(publish, plan, seed=1)
    worker_thread()

    wait_for(lambda: settled(read_rewards, events.prefix, plan), 60, "all rewards")
    assert_exactly_once(worker_engine, read_rewards, events.prefix, plan)


@pytest.fixture
def later_broker(worker_config: WorkerConfig, tmp_path: Path) -> Iterator[EmbeddedKafka]:
    """A broker of the test's own for its topics, not started; stopped after the test (after
    a worker thread the test started, when requested before `worker_thread`)."""
    topics = {worker_config.completions_topic: 2, worker_config.feedback_topic: 2}
    broker = EmbeddedKafka(tmp_path / "kafka", free_port(), topics=topics)
    yield broker
    broker.stop()


def test_a_worker_started_before_its_broker_waits_for_it_then_consumes(
    events: Any,
    worker_config: WorkerConfig,
    later_broker: EmbeddedKafka,
    worker_thread: Any,
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = get_settings().model_copy(update={"kafka_bootstrap_servers": later_broker.url})
    worker = worker_thread(settings)
    wait_for(
        lambda: any(
            r.name == "workers.consumer" and "trying again" in r.getMessage()
            for r in caplog.records
        ),
        60,
        "the worker to say it waits for Kafka",
    )
    assert worker.is_alive(), "the worker gave up on a broker that was not up yet"

    later_broker.start()
    plan = scenario(events, worker_config, 20)
    producer = KafkaProducer(bootstrap_servers=later_broker.url, acks="all")
    try:
        publisher(producer, worker_config)(*plan.completions, *plan.feedback)
    finally:
        producer.close(timeout=10)
    wait_for(lambda: settled(read_rewards, events.prefix, plan), 90, "all rewards")
    assert_exactly_once(worker_engine, read_rewards, events.prefix, plan)


def test_poison_messages_go_to_the_dead_letter_topic_and_the_stream_goes_on(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_thread: Any,
    read_rewards: Any,
    wait_for: Any,
    stack: Any,
) -> None:
    poison = [
        (worker_config.completions_topic, b"{not json"),
        (worker_config.feedback_topic, b'{"kind": "edit_accepted"}'),
        # Postgres text cannot hold NUL; in a field no model or developer writes, it is poison.
        (worker_config.completions_topic, encode(events.completion(3, finish_reason="x\x00"))),
    ]
    publish(events.completion(1), *poison, events.completion(2), events.accepted(2))
    worker_thread()

    wait_for(lambda: len(read_rewards(events.prefix)) == 2, 60, "the good messages")
    assert read_rewards(events.prefix)[events.request(2)].components["accepted"] is True
    letters = read_dead_letters(stack.kafka.url, worker_config.dlq_topic, len(poison))
    assert sorted((d.source_topic, d.payload) for d in letters) == sorted(
        (topic, value.decode()) for topic, value in poison
    )
    assert all(d.reason.startswith(("undecodable", "invalid")) for d in letters)

    # What ops see on the worker's /metrics: every message counted, the poison as dead
    # letters by the topic it came from, and nothing left to read.
    def sample(name: str, topic: str) -> float | None:
        return REGISTRY.get_sample_value(name, {"topic": topic})

    topics = {
        "completions": worker_config.completions_topic,
        "feedback": worker_config.feedback_topic,
    }
    wait_for(
        lambda: (
            sample("rtrl_worker_messages_total", topics["feedback"]) == 2
            and sample("rtrl_consumer_lag_messages", topics["completions"]) == 0
        ),
        30,
        "the worker's metrics",
    )
    assert sample("rtrl_worker_messages_total", topics["completions"]) == 4
    assert sample("rtrl_worker_dead_letters_total", topics["completions"]) == 2
    assert sample("rtrl_worker_dead_letters_total", topics["feedback"]) == 1
    assert sample("rtrl_consumer_lag_messages", topics["feedback"]) == 0


def start_worker_process(config: WorkerConfig, log: Path, max_records: int) -> subprocess.Popen:
    """`python -m workers` on the test's topics and group, logging to `log`."""
    command = [
        sys.executable,
        "-m",
        "workers",
        "--completions-topic",
        config.completions_topic,
        "--feedback-topic",
        config.feedback_topic,
        "--dlq-topic",
        config.dlq_topic,
        "--group-id",
        config.group_id,
        "--max-records",
        str(max_records),
        "--log-level",
        "DEBUG",
    ]
    env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT)}
    with log.open("ab") as out:
        return subprocess.Popen(command, cwd=PROJECT_ROOT, env=env, stdout=out, stderr=out)


@pytest.fixture
def worker_processes() -> Iterator[list[subprocess.Popen]]:
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def test_a_worker_killed_mid_stream_and_restarted_loses_and_duplicates_nothing(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_processes: list[subprocess.Popen],
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
    tmp_path: Path,
) -> None:
    plan = scenario(events, worker_config, 300)
    send_shuffled(publish, plan, seed=2)
    first = start_worker_process(worker_config, tmp_path / "first.log", max_records=20)
    worker_processes.append(first)

    wait_for(lambda: len(read_rewards(events.prefix)) >= 30, 60, "the first rewards")
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert len(read_rewards(events.prefix)) < len(plan.completions), "killed too late"

    worker_processes.append(
        start_worker_process(worker_config, tmp_path / "second.log", max_records=20)
    )
    wait_for(lambda: settled(read_rewards, events.prefix, plan), 90, "all rewards")
    assert_exactly_once(worker_engine, read_rewards, events.prefix, plan)


def test_two_workers_share_the_partitions_and_lose_and_duplicate_nothing(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_processes: list[subprocess.Popen],
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
    tmp_path: Path,
) -> None:
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    first_wave = scenario(events, worker_config, 100)
    second_wave = scenario(events, worker_config, 100, first=100)
    send_shuffled(publish, first_wave, seed=3)
    worker_processes.append(start_worker_process(worker_config, logs[0], max_records=25))
    worker_processes.append(start_worker_process(worker_config, logs[1], max_records=25))

    def both_assigned() -> bool:
        return all("newly assigned partitions" in log.read_text() for log in logs)

    wait_for(both_assigned, 60, "both workers to join the group")
    send_shuffled(publish, second_wave, seed=4)

    plan = Scenario(
        first_wave.completions + second_wave.completions,
        first_wave.feedback + second_wave.feedback,
        first_wave.expected | second_wave.expected,
    )
    wait_for(lambda: settled(read_rewards, events.prefix, plan), 90, "all rewards")
    assert_exactly_once(worker_engine, read_rewards, events.prefix, plan)
    assert all("batch of" in log.read_text() for log in logs), "a worker stayed idle"
