"""`rtrl dlq replay`: dead letters re-driven to their topics, each once, through the real
broker, and stored by a worker."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

import pytest
from kafka import KafkaConsumer, KafkaProducer
from sqlalchemy import Engine, func, select, text
from typer.testing import CliRunner

from app.config import get_settings
from app.events import CompletionEvent, DeadLetter, encode
from rtrl.cli import cli
from rtrl.embedded.stack import EmbeddedStack
from tests.workers.conftest import read_dead_letters
from workers.config import WorkerConfig
from workers.consumer import dead_letter
from workers.dlq import REPLAYED_FROM, replay_dead_letters
from workers.repository import samples


class Message(NamedTuple):
    """A message as the worker read it from its topic."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None


def send_letters(stack: EmbeddedStack, topic: str, *letters: DeadLetter) -> None:
    """Dead letters onto `topic`, as the worker sends them."""
    producer = KafkaProducer(bootstrap_servers=stack.kafka.url, acks="all")
    try:
        for letter in letters:
            key = letter.key.encode() if letter.key is not None else None
            producer.send(topic, key=key, value=encode(letter))
        producer.flush()
    finally:
        producer.close(timeout=10)


def count_samples(engine: Engine, request_id: str) -> int:
    with engine.connect() as conn:
        return conn.execute(
            select(func.count()).select_from(samples).where(samples.c.request_id == request_id)
        ).scalar_one()


def test_valid_events_dead_lettered_are_replayed_once_and_the_rest_reported(
    events: Any,
    worker_config: WorkerConfig,
    worker_thread: Any,
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
    stack: EmbeddedStack,
) -> None:
    completions, feedback = worker_config.completions_topic, worker_config.feedback_topic
    session = events.session(1).encode()

    def letter(topic: str, event: Any, reason: str, offset: int = 7) -> DeadLetter:
        return dead_letter(Message(topic, 2, offset, session, encode(event)), reason)

    budget = "over the worker's time budget: a statement storing it ran past 30 s"
    private = events.completion(3, privacy=True)
    gateway_letter = DeadLetter(
        source_topic=completions,
        partition=-1,
        offset=-1,
        key=events.session(4),
        payload='{"request_id": "r"}',
        reason="9000000 bytes: over the size Kafka takes (producer limit 8388608 bytes)",
    )
    send_letters(
        stack,
        worker_config.dlq_topic,
        letter(completions, events.completion(1), budget),
        letter(feedback, events.accepted(1), budget, offset=8),
        letter(completions, private, "rejected by the database: refused"),
        gateway_letter,
        letter("some.other.topic", events.completion(5), budget),
    )
    settings = get_settings()

    dry = replay_dead_letters(settings, worker_config, dry_run=True)
    assert dry.redriven == {completions: 1, feedback: 1}
    assert dry.reasons == {
        "over the worker's time budget": 3,
        "rejected by the database": 1,
        "over the size Kafka takes": 1,
    }
    assert sorted(dry.not_replayable.values()) == [1, 1, 1]

    lines: list[str] = []
    replayed = replay_dead_letters(settings, worker_config, progress=lines.append)
    assert replayed.redriven == dry.redriven
    assert replayed.not_replayable == dry.not_replayable
    assert lines[-1] == "5 letters read: 2 re-driven, 3 not replayable, 0 from before --since"
    assert replay_dead_letters(settings, worker_config).read == 0

    worker_thread()
    wait_for(lambda: len(read_rewards(events.prefix)) == 1, 60, "the replayed reward")
    assert read_rewards(events.prefix)[events.request(1)].components["accepted"] is True
    assert count_samples(worker_engine, events.request(1)) == 1
    assert read_dead_letters(stack.kafka.url, worker_config.dlq_topic, 6)[5:] == []

    # The re-driven messages went to the letters' own partition, saying where they came from.
    reader = KafkaConsumer(
        completions,
        bootstrap_servers=stack.kafka.url,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5_000,
    )
    try:
        (message,) = list(reader)
    finally:
        reader.close()
    assert message.partition == 2
    assert message.key == session
    assert dict(message.headers)[REPLAYED_FROM] == f"{worker_config.dlq_topic}/0/0".encode()


def test_a_limited_replay_stops_where_the_next_goes_on_and_older_letters_are_passed_over(
    events: Any, worker_config: WorkerConfig, stack: EmbeddedStack
) -> None:
    topic = worker_config.completions_topic

    def letter(n: int, failed_at: datetime) -> DeadLetter:
        message = Message(topic, 0, n, None, encode(events.completion(n)))
        return dead_letter(message, "failed: a bug").model_copy(update={"failed_at": failed_at})

    now = datetime.now(UTC)
    send_letters(
        stack,
        worker_config.dlq_topic,
        letter(1, now - timedelta(days=2)),
        letter(2, now - timedelta(minutes=1)),
        letter(3, now - timedelta(minutes=1)),
    )
    settings, since = get_settings(), now - timedelta(days=1)

    first = replay_dead_letters(settings, worker_config, since=since, limit=1)
    assert (first.passed_over, first.redriven, first.left) == (1, {topic: 1}, 1)
    assert first.stopped_at_limit
    second = replay_dead_letters(settings, worker_config, since=since)
    assert (second.read, second.redriven, second.left) == (1, {topic: 1}, 0)
    assert replay_dead_letters(settings, worker_config).read == 0

    reader = KafkaConsumer(
        topic,
        bootstrap_servers=stack.kafka.url,
        auto_offset_reset="earliest",
        consumer_timeout_ms=5_000,
    )
    try:
        sent = [CompletionEvent.model_validate_json(message.value) for message in reader]
    finally:
        reader.close()
    assert [event.request_id for event in sent] == [events.request(2), events.request(3)]


@pytest.fixture
def refuse_request(worker_engine: Engine) -> Iterator[Callable[[str], Callable[[], None]]]:
    """Makes Postgres refuse one request id's sample (a trigger on `samples`), as a bug in
    the schema or the worker would; returns the fix, which drops the trigger."""
    name = f"refuse_{uuid.uuid4().hex[:10]}"

    def fix() -> None:
        with worker_engine.begin() as conn:
            conn.execute(text(f"DROP TRIGGER IF EXISTS {name} ON samples"))
            conn.execute(text(f"DROP FUNCTION IF EXISTS {name}()"))

    def refuse(request_id: str) -> Callable[[], None]:
        with worker_engine.begin() as conn:
            conn.execute(
                text(
                    f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = 'check_violation'; END $$"
                )
            )
            conn.execute(
                text(
                    f"CREATE TRIGGER {name} BEFORE INSERT ON samples FOR EACH ROW "
                    f"WHEN (NEW.request_id = '{request_id}') EXECUTE FUNCTION {name}()"
                )
            )
        return fix

    yield refuse
    fix()


def test_a_message_the_worker_dead_lettered_is_stored_once_replayed_after_the_fix(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_thread: Any,
    worker_engine: Engine,
    read_rewards: Any,
    wait_for: Any,
    stack: EmbeddedStack,
    refuse_request: Callable[[str], Callable[[], None]],
) -> None:
    fix = refuse_request(events.request(2))
    publish(
        events.completion(1, session=0),
        events.completion(2, session=0),
        events.accepted(2, session=0),
    )
    worker_thread()
    (letter,) = read_dead_letters(stack.kafka.url, worker_config.dlq_topic, 1)
    assert letter.reason.startswith("rejected by the database")
    assert set(read_rewards(events.prefix)) == {events.request(1)}

    fix()
    report = replay_dead_letters(get_settings(), worker_config)
    assert report.redriven == {worker_config.completions_topic: 1}

    wait_for(lambda: len(read_rewards(events.prefix)) == 2, 60, "the replayed reward")
    # Its feedback, stored before, joins it.
    assert read_rewards(events.prefix)[events.request(2)].components["accepted"] is True
    assert count_samples(worker_engine, events.request(2)) == 1
    again = replay_dead_letters(get_settings(), worker_config)
    assert (again.read, sum(again.redriven.values())) == (0, 0)


def test_the_command_counts_without_sending_on_a_dry_run(stack: EmbeddedStack) -> None:
    result = CliRunner().invoke(cli, ["dlq", "replay", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "would re-drive" in result.output
