"""Messages a worker cannot process go aside with their reason; none stops the group.

Through the session's Kafka and Postgres: a message whose storing overruns the worker's
time budget, a dead letter too large for the broker.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaProducer
from sqlalchemy import Engine, text

from app.events import encode
from rtrl.embedded.stack import EmbeddedStack
from tests.workers.conftest import publisher, read_dead_letters
from workers.config import WorkerConfig


@pytest.fixture
def slow_request(worker_engine: Engine) -> Iterator[Any]:
    """Makes storing one request id's sample sleep for ten minutes (a trigger on `samples`):
    a statement that would hold the worker's batch, and the group behind it, for good."""
    made: list[str] = []

    def make(request_id: str) -> None:
        name = f"slow_{uuid.uuid4().hex[:10]}"
        with worker_engine.begin() as conn:
            conn.execute(
                text(
                    f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN PERFORM pg_sleep(600); RETURN NEW; END $$"
                )
            )
            conn.execute(
                text(
                    f"CREATE TRIGGER {name} BEFORE INSERT ON samples FOR EACH ROW "
                    f"WHEN (NEW.request_id = '{request_id}') EXECUTE FUNCTION {name}()"
                )
            )
        made.append(name)

    yield make
    with worker_engine.begin() as conn:
        # First the statements still asleep: their transactions hold `samples` against DROP.
        conn.execute(
            text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE wait_event = 'PgSleep' AND pid <> pg_backend_pid()"
            )
        )
    with worker_engine.begin() as conn:
        for name in made:
            conn.execute(text(f"DROP TRIGGER IF EXISTS {name} ON samples"))
            conn.execute(text(f"DROP FUNCTION IF EXISTS {name}()"))


def test_a_message_that_overruns_the_time_budget_goes_aside_and_the_rest_are_stored(
    events: Any,
    worker_config: WorkerConfig,
    publish: Any,
    worker_thread: Any,
    read_rewards: Any,
    wait_for: Any,
    stack: EmbeddedStack,
    slow_request: Any,
) -> None:
    slow_request(events.request(2))
    # One session, so all three share a partition and the slow one sits between the others.
    publish(
        events.completion(1, session=0),
        events.completion(2, session=0),
        events.completion(3, session=0),
        events.accepted(3, session=0),
    )
    worker_thread(config=dataclasses.replace(worker_config, statement_timeout_s=1.0))

    wait_for(lambda: len(read_rewards(events.prefix)) == 2, 60, "the other two rewards")
    stored = read_rewards(events.prefix)
    assert set(stored) == {events.request(1), events.request(3)}
    assert stored[events.request(3)].components["accepted"] is True
    (letter,) = read_dead_letters(stack.kafka.url, worker_config.dlq_topic, 1)
    assert events.request(2) in letter.payload
    assert "time budget" in letter.reason


def test_a_dead_letter_too_large_for_the_broker_is_cut_to_size_and_the_stream_goes_on(
    events: Any,
    worker_config: WorkerConfig,
    worker_thread: Any,
    read_rewards: Any,
    wait_for: Any,
    stack: EmbeddedStack,
) -> None:
    # A completion of 3 MB (a long-context prompt) with a field Postgres cannot hold: its
    # dead letter, carrying the message, is over the producer's 1 MiB default.
    poison = events.completion(2, session=0, finish_reason="x\x00", completion_text="y" * 3_000_000)
    producer = KafkaProducer(
        bootstrap_servers=stack.kafka.url, acks="all", max_request_size=16 * 1024 * 1024
    )
    try:
        publisher(producer, worker_config)(
            events.completion(1, session=0), poison, events.completion(3, session=0)
        )
    finally:
        producer.close(timeout=10)
    worker_thread()

    wait_for(lambda: len(read_rewards(events.prefix)) == 2, 60, "the other two rewards")
    (letter,) = read_dead_letters(stack.kafka.url, worker_config.dlq_topic, 1)
    assert letter.reason.startswith("invalid")
    assert "cut" in letter.reason
    assert len(letter.payload) < 1024 * 1024
    assert encode(poison).decode()[:1000] == letter.payload[:1000]
