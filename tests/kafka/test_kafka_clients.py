"""A Kafka client that cannot reach the broker leaves no thread behind.

The gateway's event sink checks topic ids every few seconds and a worker retries its
consumer until Kafka answers: through an outage each would otherwise gather one network
thread per attempt, polling a dead address for the life of the process.
"""

from __future__ import annotations

import threading

import pytest
from kafka.errors import KafkaError

from app.config import Settings
from app.events import COMPLETIONS_TOPIC
from app.kafka.topic_ids import TopicIds
from app.processes import free_port
from workers.config import WorkerConfig
from workers.consumer import make_consumer


def kafka_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith("kafka-")]


def test_the_gateways_topic_check_through_an_outage_leaves_no_thread_behind() -> None:
    topic_ids = TopicIds(f"127.0.0.1:{free_port()}", timeout_ms=300)
    before = kafka_threads()
    for _ in range(3):
        assert topic_ids.read({COMPLETIONS_TOPIC}) is None  # no answer, no ids
    assert kafka_threads() == before


def test_a_worker_that_cannot_reach_kafka_leaves_no_thread_behind() -> None:
    settings = Settings(kafka_bootstrap_servers=f"127.0.0.1:{free_port()}")
    before = kafka_threads()
    with pytest.raises(KafkaError):
        make_consumer(settings, WorkerConfig())
    assert kafka_threads() == before
