"""Topic durability: `rtrl migrate` creates rtrl's topics as durable as the settings ask, and
the processes refuse topics that are less so.

The session's broker is a single one (Tansu): there the topics hold one replica, and the
check lets them through. Clusters of several brokers are judged on descriptions in the
shape kafka-python gives them (as the session's broker answered them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import pytest

from app.config import Settings
from app.db import PROJECT_ROOT
from app.kafka.admin import ensure_topics
from app.kafka.topics import (
    UNREPLICATED,
    Durability,
    check_topic_durability,
    durability_problems,
)
from rtrl.embedded.stack import EmbeddedStack

PRODUCTION = Durability(replication_factor=3, min_insync_replicas=2)


def described(name: str, replicas: list[list[int]]) -> dict[str, Any]:
    """A topic as `KafkaAdminClient.describe_topics` describes it: one replica list a partition."""
    return {
        "error_code": 0,
        "name": name,
        "partitions": [
            {"partition_index": i, "replica_nodes": nodes, "isr_nodes": nodes}
            for i, nodes in enumerate(replicas)
        ],
    }


def test_topics_with_fewer_replicas_or_a_lower_insync_minimum_are_named_with_the_setting() -> None:
    topics = [
        described("rtrl.completions.v1", [[1, 2, 3], [2, 3]]),
        described("rtrl.feedback.v1", [[1, 2, 3], [2, 3, 1]]),
        described("rtrl.dlq.v1", [[1, 2, 3]]),
    ]
    configs = {
        "rtrl.completions.v1": {"min.insync.replicas": "2"},
        "rtrl.feedback.v1": {"min.insync.replicas": "1"},
        "rtrl.dlq.v1": {"min.insync.replicas": "2"},
    }
    assert durability_problems(topics, configs, PRODUCTION) == [
        "rtrl.completions.v1 has 2 replica(s) a partition, "
        "RTRL_KAFKA_REPLICATION_FACTOR asks for 3",
        "rtrl.feedback.v1 has min.insync.replicas=1, RTRL_KAFKA_MIN_INSYNC_REPLICAS asks for 2",
    ]
    assert durability_problems(topics[1:], {}, PRODUCTION) == []  # no config reported


def test_a_single_broker_holds_one_replica_and_a_larger_cluster_what_was_asked() -> None:
    assert PRODUCTION.on(1) == UNREPLICATED
    assert PRODUCTION.on(2) == PRODUCTION  # too small: creating or checking fails there
    assert PRODUCTION.on(5) == PRODUCTION


def test_the_insync_minimum_cannot_exceed_the_replicas() -> None:
    with pytest.raises(ValueError, match="RTRL_KAFKA_MIN_INSYNC_REPLICAS"):
        Settings(kafka_replication_factor=2, kafka_min_insync_replicas=3)


def test_migrate_on_a_single_broker_creates_the_topics_unreplicated_and_says_so(
    stack: EmbeddedStack,
) -> None:
    env = {
        **os.environ,
        **stack.environment(),
        "RTRL_KAFKA_REPLICATION_FACTOR": "3",
        "RTRL_KAFKA_MIN_INSYNC_REPLICAS": "2",
    }
    result = subprocess.run(
        [sys.executable, "-m", "rtrl.cli", "migrate"],
        cwd=PROJECT_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "single-broker Kafka: topics are unreplicated" in result.stderr
    assert "topics present (1 replica(s) a partition, min.insync.replicas=1)" in result.stdout


def test_the_check_lets_a_single_brokers_topics_through_and_leaves_missing_ones_to_others(
    stack: EmbeddedStack,
) -> None:
    topic = f"test.durable.{uuid.uuid4().hex[:8]}"
    created = ensure_topics(stack.kafka.url, {topic: 2}, durability=PRODUCTION)
    assert created == UNREPLICATED
    settings = Settings(kafka_bootstrap_servers=stack.kafka.url)
    assert check_topic_durability(settings, [topic, f"{topic}.absent"]) == UNREPLICATED
