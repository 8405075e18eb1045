"""Which Kafka log a topic's events are in: its topic id (KIP-516).

A topic gets its id when it is created, and a broker that keeps its log keeps the id across
restarts. A broker that lost its log has the topic re-created under a new id: the embedded
Tansu after any restart (it keeps messages in memory only), or any Kafka whose topic was
deleted and created again. The cluster id cannot tell: Tansu reports `tansu_cluster` after
every restart. The gateways' event sink watches the ids to send its retained events again;
the workers, to read a re-created log from its start.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Mapping
from typing import Any

from kafka.admin import KafkaAdminClient

from app.kafka.clients import kafka_client

log = logging.getLogger(__name__)

NO_ERROR = 0


class TopicIds:
    """Reads topic ids from the broker through one admin connection, opened when first needed."""

    def __init__(
        self,
        bootstrap_servers: str,
        *,
        timeout_ms: int = 3_000,
        security: Mapping[str, Any] | None = None,
        client_id: str = "rtrl-gateway-topics",
    ) -> None:
        self._options = {
            "bootstrap_servers": bootstrap_servers.split(","),
            "client_id": client_id,
            "request_timeout_ms": timeout_ms,
            "bootstrap_timeout_ms": timeout_ms,
            **(security or {}),
        }
        self._admin: KafkaAdminClient | None = None

    def read(self, topics: Collection[str]) -> dict[str, str | None] | None:
        """Each topic's id, None for a topic the broker does not have; None if it did not answer."""
        try:
            if self._admin is None:
                self._admin = kafka_client(KafkaAdminClient, **self._options)
            described = self._admin.describe_topics(sorted(topics))
        except Exception as exc:
            log.info("could not read topic ids (%s)", exc)
            self.close()
            return None
        found: dict[str, str | None] = dict.fromkeys(topics)
        for topic in described:
            if topic["error_code"] == NO_ERROR:
                # A broker older than Kafka 2.8 has no ids: "" then never changes.
                found[topic["name"]] = str(topic["topic_id"] or "")
        return found

    def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            with contextlib.suppress(Exception):
                admin.close()
