"""Create rtrl's topics on a cluster, as durable as the settings ask: `rtrl migrate`, the
embedded broker and the tests all create them here."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from app.events import COMPLETIONS_TOPIC, DLQ_TOPIC, FEEDBACK_TOPIC
from app.kafka.clients import kafka_client
from app.kafka.topics import UNREPLICATED, Durability
from app.processes import ServiceError

# Partitions per topic: sessions are keys, so parallelism comes from partitions.
DEFAULT_TOPICS = {COMPLETIONS_TOPIC: 4, FEEDBACK_TOPIC: 4, DLQ_TOPIC: 1}


def ensure_topics(
    bootstrap_servers: str,
    topics: dict[str, int],
    *,
    timeout: float = 30,
    topic_configs: dict[str, str] | None = None,
    security: Mapping[str, Any] | None = None,
    durability: Durability = UNREPLICATED,
) -> Durability:
    """Create any missing topic (with `topic_configs`, e.g. `max.message.bytes`) as durable
    as `durability` asks, or unreplicated on a single broker; returns the durability they
    were created with. A broker restart with memory storage forgets them all."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            admin = kafka_client(
                KafkaAdminClient,
                bootstrap_servers=bootstrap_servers,
                client_id="rtrl-admin",
                request_timeout_ms=10_000,
                **(security or {}),
            )
            break
        except KafkaError as exc:
            if time.monotonic() > deadline:
                raise ServiceError(f"kafka: cannot reach {bootstrap_servers}: {exc}") from exc
            time.sleep(0.2)
    try:
        durability = durability.on(len(admin.describe_cluster()["brokers"]))
        existing = set(admin.list_topics())
        missing = [
            NewTopic(
                name=name,
                num_partitions=partitions,
                replication_factor=durability.replication_factor,
                topic_configs=dict(topic_configs or {}) | durability.topic_configs(),
            )
            for name, partitions in topics.items()
            if name not in existing
        ]
        if missing:
            with contextlib.suppress(TopicAlreadyExistsError):
                admin.create_topics(missing)
    finally:
        admin.close()
    return durability
