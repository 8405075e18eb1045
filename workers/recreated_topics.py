"""A topic re-created under a running worker is read again from its start.

A broker that lost a topic's log gives the re-created topic a new id (`app.kafka.topic_ids`): the
embedded Tansu after any restart, any Kafka whose topic was deleted and created again. A
worker reading it keeps its positions in the old log unless its group happens to rebalance:
Tansu answers a fetch past the new log's end with nothing (the worker would wait until the
new log outgrew its old position), and Apache Kafka serves from that position as soon as the
new log has grown past it, skipping what came before. The worker compares the ids every few
seconds (`WorkerConfig.topic_check_interval_s`) and, when one changed, seeks its partitions of
that topic to their beginning; what it stored already is deduplicated by event id.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kafka import KafkaConsumer

from app.kafka.topic_ids import TopicIds
from workers.metrics import TOPICS_RECREATED

log = logging.getLogger(__name__)


class RecreatedTopics:
    """Rewinds a consumer's partitions of any topic whose id changed since it last looked."""

    def __init__(self, topic_ids: TopicIds, topics: Sequence[str]) -> None:
        self._topic_ids = topic_ids
        self._topics = tuple(topics)
        self._seen: dict[str, str] = {}

    def check(self, consumer: KafkaConsumer) -> list[str]:
        """The topics found re-created since the last answer, this consumer's partitions of
        them rewound to the beginning. The first answer is what later ones are compared with;
        a broker that does not answer, or lacks a topic for now, changes nothing."""
        current = self._topic_ids.read(self._topics)
        if current is None:
            return []
        known = {topic: topic_id for topic, topic_id in current.items() if topic_id}
        recreated = sorted(
            topic
            for topic, topic_id in known.items()
            if self._seen.get(topic, topic_id) != topic_id
        )
        self._seen |= known
        if not recreated:
            return []
        # Partitions being reassigned are not the consumer's now: their next owner starts
        # from the group's committed offsets, which the lost log took with it.
        partitions = [
            partition for partition in consumer.assignment() if partition.topic in recreated
        ]
        if partitions:
            consumer.seek_to_beginning(*partitions)
        for topic in recreated:
            TOPICS_RECREATED.labels(topic).inc()
        log.warning(
            "topics %s were re-created (new topic ids): reading this worker's %d partitions "
            "of them again from the start",
            ", ".join(recreated),
            len(partitions),
        )
        return recreated

    def close(self) -> None:
        self._topic_ids.close()
