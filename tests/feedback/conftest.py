"""A gateway app in this process with real completions to give feedback on."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import orjson
import pytest
from fastapi.testclient import TestClient
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Engine

from app.auth.service import new_api_key
from app.config import Settings
from app.db import session_scope
from app.events import FEEDBACK_TOPIC
from app.main import create_app
from app.models import Role
from app.serving.publish import ensure_base_checkpoint
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack

MAX_BATCH = 5


@pytest.fixture(scope="module")
def client(
    stack: EmbeddedStack,
    engine: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[TestClient]:
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(tiny_model_dir))
    settings = Settings(
        data_dir=tmp_path_factory.mktemp("gateway"),
        vllm_urls=[vllm_server.url],
        max_feedback_batch=MAX_BATCH,
        max_request_bytes=64 * 1024,
    )
    with TestClient(create_app(settings)) as client:
        yield client


@pytest.fixture(scope="module")
def make_key(engine: Engine) -> Callable[..., str]:
    def make(**fields: Any) -> str:
        with session_scope(engine) as session:
            row, secret = new_api_key(name=f"test-{uuid.uuid4().hex[:8]}", role=Role.ide, **fields)
            session.add(row)
        return secret

    return make


@pytest.fixture(scope="module")
def ide_key(make_key: Callable[..., str]) -> str:
    return make_key()


@pytest.fixture
def serve(client: TestClient, ide_key: str) -> Callable[..., tuple[str, str]]:
    """Has the gateway serve a real completion; returns its (session id, request id)."""

    def completion(key: str | None = None, **headers: str) -> tuple[str, str]:
        session, request_id = f"s-{uuid.uuid4().hex[:10]}", f"r-{uuid.uuid4().hex[:10]}"
        response = client.post(
            "/v1/chat/completions",
            json={
                "model": "rtrl",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            headers={
                "Authorization": f"Bearer {key or ide_key}",
                "X-Session-Id": session,
                "X-Request-Id": request_id,
                **headers,
            },
        )
        assert response.status_code == 200, response.text
        return session, request_id

    return completion


class FeedbackTopic:
    """Reads `rtrl.feedback.v1` from a fresh consumer, from offsets marked earlier."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.bootstrap, self.topic = bootstrap, topic

    def _consumer(self) -> tuple[KafkaConsumer, list[TopicPartition]]:
        consumer = KafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        partitions = [
            TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic)
        ]
        consumer.assign(partitions)
        return consumer, partitions

    def mark(self) -> dict[TopicPartition, int]:
        consumer, partitions = self._consumer()
        try:
            return dict(consumer.end_offsets(partitions))
        finally:
            consumer.close()

    def read_until(
        self, since: dict[TopicPartition, int], event_id: str, timeout: float = 20
    ) -> list[dict[str, Any]]:
        """Everything after `since` up to and including the event `event_id`."""
        consumer, partitions = self._consumer()
        try:
            for tp in partitions:
                consumer.seek(tp, since.get(tp, 0))
            events: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                for records in consumer.poll(timeout_ms=200).values():
                    events += [orjson.loads(r.value) | {"_key": r.key.decode()} for r in records]
                if any(event["event_id"] == event_id for event in events):
                    return events
            raise AssertionError(f"event {event_id} never reached Kafka")
        finally:
            consumer.close()


@pytest.fixture
def feedback_topic(stack: EmbeddedStack) -> FeedbackTopic:
    return FeedbackTopic(stack.kafka.url, FEEDBACK_TOPIC)
