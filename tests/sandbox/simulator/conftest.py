"""A real gateway on a socket (session Postgres, Kafka, Redis, vLLM) for the simulator."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import uvicorn
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
from rtrl.embedded.stack import EmbeddedStack


@pytest.fixture(scope="module")
def gateway_url(
    engine: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[str]:
    """The gateway app served by uvicorn in a thread, the base model registered."""
    with session_scope(engine) as session:
        ensure_base_checkpoint(session, str(tiny_model_dir))
    settings = Settings(data_dir=tmp_path_factory.mktemp("gateway"), vllm_urls=[vllm_server.url])
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=port, log_config=None, access_log=False
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)


@pytest.fixture(scope="module")
def ide_key(engine: Engine) -> str:
    with session_scope(engine) as session:
        row, secret = new_api_key(name=f"simulator-{uuid.uuid4().hex[:8]}", role=Role.ide)
        session.add(row)
    return secret


@pytest.fixture
def read_topic(stack: EmbeddedStack) -> Callable[..., list[dict[str, Any]]]:
    """Reads a topic from the beginning until `until(events)` holds or `timeout` passes."""

    def read(
        topic: str, until: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        consumer = KafkaConsumer(bootstrap_servers=stack.kafka.url, enable_auto_commit=False)
        try:
            partitions = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(partitions)
            consumer.seek_to_beginning(*partitions)
            events: list[dict[str, Any]] = []
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and not until(events):
                for records in consumer.poll(timeout_ms=200).values():
                    events += [orjson.loads(record.value) for record in records]
            return events
        finally:
            consumer.close()

    return read
