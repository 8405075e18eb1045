"""Fixtures for the worker tests: unique topics, a producer, events with unique ids."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer
from sqlalchemy import Connection, Engine, select

from app.config import Settings, get_settings
from app.events import (
    CompletionEvent,
    DeadLetter,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
    encode,
)
from app.signals.rewards import Feedback
from rtrl.embedded.stack import EmbeddedStack
from tests.conftest import fresh_worker_config
from workers.config import WorkerConfig
from workers.consumer import run_worker
from workers.repository import make_worker_engine, rewards, samples


@dataclasses.dataclass
class Events:
    """Builds events whose session and request ids carry this test's unique prefix."""

    prefix: str
    served_at: datetime

    def session(self, n: int) -> str:
        return f"{self.prefix}-s{n}"

    def request(self, n: int) -> str:
        return f"{self.prefix}-r{n}"

    def completion(self, n: int, *, session: int | None = None, **fields: Any) -> CompletionEvent:
        defaults: dict[str, Any] = {
            "session_id": self.session(n if session is None else session),
            "request_id": self.request(n),
            "occurred_at": self.served_at,
            "checkpoint": "ckpt-test",
            "user_hash": "u" + self.prefix,
            "edit_requested": True,
            "proposed_edit": True,
            "prompt_messages": [{"role": "user", "content": 'Write f(x), {quoted} "x", 不对'}],
            "prompt_token_ids": [1, 2, 3],
            "completion_token_ids": [4, 5],
            "behaviour_logprobs": [-0.5, -0.25],
            "completion_text": "def f(x):\n    return x + 3\n",
            "completion_chars": 27,
            "ttft_ms": 50.0,
            "latency_ms": 400.0,
        }
        if fields.get("privacy"):
            for content in (
                "prompt_messages",
                "prompt_token_ids",
                "completion_token_ids",
                "behaviour_logprobs",
            ):
                defaults[content] = None
            defaults["completion_text"] = None
        return CompletionEvent(**(defaults | fields))

    def _common(self, n: int, after_s: float, session: int | None) -> dict[str, Any]:
        return {
            "session_id": self.session(n if session is None else session),
            "request_id": self.request(n),
            "occurred_at": self.served_at + timedelta(seconds=after_s),
        }

    def accepted(self, n: int, after_s: float = 5, session: int | None = None) -> EditAccepted:
        return EditAccepted(**self._common(n, after_s, session))

    def rejected(self, n: int, after_s: float = 5, session: int | None = None) -> EditRejected:
        return EditRejected(**self._common(n, after_s, session))

    def survival(
        self, n: int, elapsed_s: float, share: float, session: int | None = None
    ) -> EditSurvival:
        return EditSurvival(
            **self._common(n, 5 + elapsed_s, session), elapsed_s=elapsed_s, surviving_share=share
        )

    def followup(
        self, n: int, message: str | None, after_s: float = 30, session: int | None = None
    ) -> FollowupMessage:
        return FollowupMessage(**self._common(n, after_s, session), message=message)

    def session_end(self, n: int, after_s: float = 60, session: int | None = None) -> SessionEnd:
        return SessionEnd(**self._common(n, after_s, session))


@pytest.fixture
def events() -> Events:
    return Events(prefix=f"t{uuid.uuid4().hex[:10]}", served_at=datetime.now(UTC))


@pytest.fixture
def conn(engine: Engine) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back after the test."""
    with engine.connect() as connection:
        transaction = connection.begin()
        try:
            yield connection
        finally:
            transaction.rollback()


@pytest.fixture(scope="session")
def worker_engine(stack: EmbeddedStack) -> Iterator[Engine]:
    engine = make_worker_engine(stack.postgres.url)
    yield engine
    engine.dispose()


@pytest.fixture
def worker_config(stack: EmbeddedStack) -> WorkerConfig:
    """Fresh topics and consumer group for one test, short group timeouts, no housekeeping."""
    return fresh_worker_config(stack.kafka.url)


@pytest.fixture
def producer(stack: EmbeddedStack) -> Iterator[KafkaProducer]:
    """A producer of the test's own: idempotent, and a broker restarted by an earlier test
    (memory storage) would answer a longer-lived one's producer id UnknownProducerId forever."""
    producer = KafkaProducer(
        bootstrap_servers=stack.kafka.url, acks="all", enable_idempotence=True, linger_ms=5
    )
    yield producer
    producer.close(timeout=10)


@pytest.fixture
def publish(producer: KafkaProducer, worker_config: WorkerConfig) -> Callable[..., None]:
    """Send events (or raw bytes) to the test's topics, keyed by session like the gateway."""
    return publisher(producer, worker_config)


def publisher(producer: KafkaProducer, worker_config: WorkerConfig) -> Callable[..., None]:
    """Sends events (or raw `(topic, bytes)` pairs) through `producer` to the topics of
    `worker_config`, keyed by session like the gateway."""

    def send(*items: CompletionEvent | Feedback | tuple[str, bytes]) -> None:
        for item in items:
            if isinstance(item, tuple):
                topic, value = item
                producer.send(topic, key=b"poison", value=value)
                continue
            topic = (
                worker_config.completions_topic
                if isinstance(item, CompletionEvent)
                else worker_config.feedback_topic
            )
            producer.send(topic, key=item.session_id.encode(), value=encode(item))
        producer.flush()

    return send


@pytest.fixture
def read_rewards(worker_engine: Engine) -> Callable[[str], dict[str, Any]]:
    """Reads the reward rows of the samples whose request id starts with a prefix."""

    def read(prefix: str) -> dict[str, Any]:
        with worker_engine.connect() as connection:
            rows = connection.execute(
                select(samples.c.request_id, rewards)
                .join(rewards, rewards.c.sample_id == samples.c.id)
                .where(samples.c.request_id.startswith(prefix))
            )
            return {row.request_id: row for row in rows}

    return read


@pytest.fixture
def wait_for() -> Callable[[Callable[[], bool], float, str], None]:
    """Waits until a condition holds, or fails saying what it waited for."""

    def wait(condition: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.1)

    return wait


@pytest.fixture
def worker_thread(worker_config: WorkerConfig) -> Iterator[Any]:
    """Starts `run_worker` in a thread (on the session's settings and the test's config, or
    those given) and returns it; stops and joins it after the test."""
    stop = threading.Event()
    threads = []

    def start(
        settings: Settings | None = None, config: WorkerConfig | None = None
    ) -> threading.Thread:
        thread = threading.Thread(
            target=run_worker,
            args=(settings or get_settings(),),
            kwargs={"stop_event": stop, "config": config or worker_config},
            daemon=True,
        )
        thread.start()
        threads.append(thread)
        return thread

    yield start
    stop.set()
    for thread in threads:
        thread.join(timeout=30)


def read_dead_letters(kafka_url: str, topic: str, count: int) -> list[DeadLetter]:
    """The first `count` dead letters on `topic` (fewer if they do not come within 10 s)."""
    dlq = KafkaConsumer(
        topic,
        bootstrap_servers=kafka_url,
        auto_offset_reset="earliest",
        consumer_timeout_ms=10_000,
        max_partition_fetch_bytes=16 * 1024 * 1024,
    )
    letters = []
    try:
        for message in dlq:
            letters.append(DeadLetter.model_validate_json(message.value))
            if len(letters) == count:
                break
    finally:
        dlq.close()
    return letters
