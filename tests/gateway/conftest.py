"""The gateway against the session's real Postgres, Redis, Kafka and vLLM."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn
from fastapi import FastAPI
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Engine

from app.auth.service import new_api_key
from app.config import Settings
from app.db import session_scope
from app.main import create_app
from app.models import Role
from app.processes import free_port
from app.serving.publish import ensure_base_checkpoint
from app.serving.vllm import VllmServer
from rtrl.embedded.kafka import EmbeddedKafka
from rtrl.embedded.stack import EmbeddedStack


@pytest.fixture
def gateway_settings(stack: EmbeddedStack, vllm_server: VllmServer, tmp_path: Path) -> Settings:
    """Settings of one gateway: the session's services, its own spool."""
    return Settings(data_dir=tmp_path / "gateway", vllm_urls=[vllm_server.url])


@pytest.fixture
def registry(engine: Engine, tiny_model_dir: Path) -> Engine:
    """The checkpoint registry with the base model registered."""
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(tiny_model_dir))
    return engine


@pytest.fixture
def make_key(engine: Engine) -> Callable[..., str]:
    """Creates an API key in Postgres and returns its secret."""

    def make(role: Role = Role.ide, **fields: Any) -> str:
        with session_scope(engine) as session:
            row, secret = new_api_key(name=f"test-{uuid.uuid4().hex[:8]}", role=role, **fields)
            session.add(row)
        return secret

    return make


@pytest.fixture
def ide_key(make_key: Callable[..., str]) -> str:
    return make_key()


@dataclass
class GatewayServer:
    """The gateway app served by uvicorn on a free port, in a thread of this process."""

    settings: Settings
    port: int = field(default_factory=free_port)
    app: FastAPI = field(init=False)
    _server: uvicorn.Server | None = field(default=None, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> GatewayServer:
        self.app = create_app(self.settings)
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_config=None, access_log=False
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=60)
            self._server = self._thread = None


@pytest.fixture
def start_gateway(registry: Engine) -> Iterator[Callable[[Settings], GatewayServer]]:
    """Starts gateways (stop them to restart); whatever still runs stops after the test."""
    servers: list[GatewayServer] = []

    def start(settings: Settings) -> GatewayServer:
        servers.append(GatewayServer(settings).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def gateway_server(
    gateway_settings: Settings, start_gateway: Callable[[Settings], GatewayServer]
) -> GatewayServer:
    return start_gateway(gateway_settings)


class KafkaTopics:
    """Reads what the gateway produced, from a fresh consumer with no group."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap

    def _consumer(self) -> KafkaConsumer:
        return KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            consumer_timeout_ms=500,
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
        )

    @staticmethod
    def for_requests(request_ids: set[str]) -> Callable[[list[dict[str, Any]]], bool]:
        """`until` condition: an event for every one of these request ids was read."""
        return lambda events: request_ids <= {event["request_id"] for event in events}

    @staticmethod
    def duplicates(events: list[dict[str, Any]]) -> dict[str, int]:
        """Event ids read more than once."""
        return {eid: n for eid, n in Counter(e["event_id"] for e in events).items() if n > 1}

    def end_offsets(self, topic: str) -> dict[int, int]:
        consumer = self._consumer()
        try:
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            return {tp.partition: offset for tp, offset in consumer.end_offsets(partitions).items()}
        finally:
            consumer.close()

    def read(
        self,
        topic: str,
        since: dict[int, int] | None = None,
        *,
        until: Callable[[list[dict[str, Any]]], bool] = lambda events: False,
        timeout: float = 20.0,
    ) -> list[dict[str, Any]]:
        """Events after `since` (default: from the beginning), read until `until` holds."""
        consumer = self._consumer()
        try:
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(partitions)
            for tp in partitions:
                consumer.seek(tp, (since or {}).get(tp.partition, 0))
            events: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=200).values():
                    for record in records:
                        event = orjson.loads(record.value)
                        event["_key"] = record.key.decode() if record.key else None
                        events.append(event)
                if until(events):
                    break
            return events
        finally:
            consumer.close()


@pytest.fixture
def kafka(stack: EmbeddedStack) -> KafkaTopics:
    return KafkaTopics(stack.kafka.url)


@pytest.fixture
def own_kafka(tmp_path: Path) -> Iterator[EmbeddedKafka]:
    """A broker of this test's own, to restart without disturbing the session's."""
    kafka = EmbeddedKafka(tmp_path / "kafka", free_port(), topics={"test.replay": 1})
    kafka.start()
    try:
        yield kafka
    finally:
        kafka.stop()


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 30) -> list[bytes]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partition = TopicPartition(topic, 0)
        consumer.assign([partition])
        consumer.seek_to_beginning(partition)
        values: list[bytes] = []
        deadline = time.monotonic() + timeout
        while len(values) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                values += [record.value for record in records]
        time.sleep(0.5)
        for records in consumer.poll(timeout_ms=500).values():
            values += [record.value for record in records]
        return values
    finally:
        consumer.close()
