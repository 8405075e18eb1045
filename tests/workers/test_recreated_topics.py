"""A topic re-created under a running worker (the broker lost its log) is read again from its
start, not from the worker's position in the log that was lost."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from prometheus_client import REGISTRY

from app.kafka.clients import kafka_client
from app.kafka.topic_ids import TopicIds
from app.processes import free_port
from rtrl.embedded.kafka import EmbeddedKafka
from workers.recreated_topics import RecreatedTopics

TOPIC = "rtrl.test.recreated"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[EmbeddedKafka]:
    """A broker of the test's own: it is restarted, which loses every log (memory storage)."""
    kafka = EmbeddedKafka(tmp_path / "kafka", free_port(), topics={TOPIC: 1})
    kafka.start()
    yield kafka
    kafka.stop()


def produce(kafka: EmbeddedKafka, values: list[bytes]) -> None:
    producer = kafka_client(KafkaProducer, bootstrap_servers=kafka.url, acks="all")
    try:
        for value in values:  # one at a time: each its own batch and offset
            producer.send(TOPIC, value).get(timeout=30)
    finally:
        producer.close(timeout=10)


def read(consumer: KafkaConsumer, count: int, seconds: float) -> list[bytes]:
    """What the consumer reads in `seconds`, stopping early at `count` messages."""
    values: list[bytes] = []
    deadline = time.monotonic() + seconds
    while len(values) < count and time.monotonic() < deadline:
        polled = consumer.poll(timeout_ms=500)
        values += [record.value for batch in polled.values() for record in batch]
    return values


def recreated_count() -> float:
    return REGISTRY.get_sample_value("rtrl_worker_topics_recreated_total", {"topic": TOPIC}) or 0.0


def test_a_consumer_reads_a_recreated_topic_from_its_start(broker: EmbeddedKafka) -> None:
    consumer = kafka_client(
        KafkaConsumer,
        bootstrap_servers=broker.url,
        group_id=None,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    watcher = RecreatedTopics(TopicIds(broker.url, client_id="rtrl-test-topics"), [TOPIC])
    try:
        consumer.assign([TopicPartition(TOPIC, 0)])
        assert watcher.check(consumer) == []  # the log it starts on
        old = [f"old-{n}".encode() for n in range(6)]
        produce(broker, old)
        assert read(consumer, len(old), 30) == old

        broker.stop()
        broker.start()  # every log lost; the topic re-created, empty, under a new id
        new = [b"new-0", b"new-1"]
        produce(broker, new)
        # Its position (6) is past the new log's end: the broker answers with nothing.
        assert read(consumer, 1, 3) == []

        counted = recreated_count()
        assert watcher.check(consumer) == [TOPIC]
        assert recreated_count() == counted + 1
        assert read(consumer, len(new), 30) == new
        assert watcher.check(consumer) == []  # the same log: nothing to rewind
    finally:
        watcher.close()
        consumer.close(autocommit=False)
