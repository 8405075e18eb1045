"""How durable rtrl's Kafka topics are, and a check that the cluster's topics are that durable.

In production the topics are replicated (`RTRL_KAFKA_REPLICATION_FACTOR`, 3) and a write is
acknowledged only once `RTRL_KAFKA_MIN_INSYNC_REPLICAS` (2) replicas have it: the producers
send with `acks=all`, so one broker lost loses nothing. `rtrl migrate` creates the topics so;
the gateway and the workers refuse to start on topics that are less durable than that. A
single-broker cluster (the embedded broker, a laptop) cannot replicate: there the topics have
one replica and the check says so instead of refusing.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kafka.admin import ConfigResource, ConfigResourceType, KafkaAdminClient
from kafka.errors import KafkaError

from app.config import Settings
from app.kafka.clients import kafka_client, kafka_security

log = logging.getLogger(__name__)

MIN_INSYNC = "min.insync.replicas"


class TopicDurabilityError(RuntimeError):
    """Topics less durable than the settings ask for; the text names each and the fix."""


@dataclass(frozen=True)
class Durability:
    """Replicas of each partition, and how many must have a write before it is acknowledged."""

    replication_factor: int
    min_insync_replicas: int

    def on(self, brokers: int) -> Durability:
        """What a cluster of `brokers` can hold: unreplicated on a single broker, else this
        (a cluster too small for it fails when the topics are created or checked)."""
        return UNREPLICATED if brokers == 1 else self

    def topic_configs(self) -> dict[str, str]:
        return {MIN_INSYNC: str(self.min_insync_replicas)}


UNREPLICATED = Durability(replication_factor=1, min_insync_replicas=1)


def configured(settings: Settings) -> Durability:
    """The durability the settings ask of rtrl's topics."""
    return Durability(settings.kafka_replication_factor, settings.kafka_min_insync_replicas)


def durability_problems(
    described: Sequence[Mapping[str, Any]],
    configs: Mapping[str, Mapping[str, str]],
    required: Durability,
) -> list[str]:
    """What falls short of `required` in topics as `KafkaAdminClient.describe_topics`
    describes them, with their configs as `describe_configs` reports them (a broker that
    reports no `min.insync.replicas` is not judged on it)."""
    problems = []
    for topic in described:
        if topic.get("error_code"):
            continue  # one that does not exist: whoever needs it says so
        name = topic["name"]
        replicas = min((len(p["replica_nodes"]) for p in topic["partitions"]), default=0)
        if replicas < required.replication_factor:
            problems.append(
                f"{name} has {replicas} replica(s) a partition, "
                f"RTRL_KAFKA_REPLICATION_FACTOR asks for {required.replication_factor}"
            )
        insync = configs.get(name, {}).get(MIN_INSYNC)
        if insync is not None and int(insync) < required.min_insync_replicas:
            problems.append(
                f"{name} has {MIN_INSYNC}={insync}, "
                f"RTRL_KAFKA_MIN_INSYNC_REPLICAS asks for {required.min_insync_replicas}"
            )
    return problems


def topic_configs(admin: KafkaAdminClient, topics: Iterable[str]) -> dict[str, dict[str, str]]:
    """Each topic's configs by name, defaults included, as the broker reports them (some
    brokers report none)."""
    answer = admin.describe_configs(
        [ConfigResource(ConfigResourceType.TOPIC, topic) for topic in topics], config_filter="all"
    )
    return {
        name: {key: str(config.get("value")) for key, config in configs.items()}
        for name, configs in answer.get("topic", {}).items()
    }


def check_topic_durability(settings: Settings, topics: Iterable[str]) -> Durability:
    """The durability the topics must have on the settings' cluster; TopicDurabilityError
    when one has less, KafkaError when the broker does not answer."""
    topics = list(topics)
    admin = kafka_client(
        KafkaAdminClient,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="rtrl-topic-check",
        request_timeout_ms=10_000,
        bootstrap_timeout_ms=5_000,
        **kafka_security(settings),
    )
    try:
        brokers = len(admin.describe_cluster()["brokers"])
        required = configured(settings)
        wanted = required.on(brokers)
        problems = durability_problems(
            admin.describe_topics(topics), topic_configs(admin, topics), wanted
        )
    finally:
        admin.close()
    if problems:
        raise TopicDurabilityError(
            "Kafka topics less durable than configured: "
            + "; ".join(problems)
            + ". Alter them (kafka-reassign-partitions, kafka-configs) or set the"
            " RTRL_KAFKA_* settings to what the cluster is meant to hold."
        )
    if wanted != required:
        log.warning(
            "Kafka at %s is a single broker: topics are unreplicated, a lost broker loses"
            " what it held (production runs RTRL_KAFKA_REPLICATION_FACTOR=%d)",
            settings.kafka_bootstrap_servers,
            required.replication_factor,
        )
    return wanted


def check_topics_if_reachable(settings: Settings, topics: Iterable[str]) -> None:
    """`check_topic_durability` for a process that starts without Kafka (the gateway spools):
    a broker that does not answer is logged and left to the workers, which wait for it."""
    try:
        check_topic_durability(settings, topics)
    except KafkaError as exc:
        log.warning("Kafka topics not checked (%s); the workers check them when they connect", exc)
