"""Privacy is a property of the completion: whatever headers each call carries, a private
completion's prompt and follow-up text reach neither Kafka nor Postgres, only a verdict."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
from kafka import KafkaConsumer, TopicPartition
from sqlalchemy import Engine, inspect, text

from app.events import TOPICS
from app.models import Role
from tests.reliability.conftest import Loop, make_key, wait_until

pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class PrivateSession:
    """One completion and its dissatisfied follow-up, each carrying a marker of its own."""

    name: str
    session_id: str
    request_id: str
    prompt_marker: str
    followup_marker: str
    followup_event_id: str
    private_completion: bool


def marker(kind: str) -> str:
    return f"zq{kind}{uuid.uuid4().hex}"


def work(
    loop: Loop, name: str, key: str, *, chat_header: bool, feedback_header: bool, private: bool
) -> PrivateSession:
    """A completion asked with a marked prompt, then a marked complaint reported on it."""
    session_id, request_id = f"s-{uuid.uuid4().hex[:12]}", f"r-{uuid.uuid4().hex[:12]}"
    prompt_marker, followup_marker = marker("prompt"), marker("followup")
    privacy = {"X-Rtrl-Privacy": "1"}
    chat = httpx.post(
        f"{loop.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": f"Write f(x) for {prompt_marker}."}],
            "max_tokens": 4,
        },
        headers={
            "Authorization": f"Bearer {key}",
            "X-Session-Id": session_id,
            "X-Request-Id": request_id,
            **(privacy if chat_header else {}),
        },
        timeout=60,
    )
    assert chat.status_code == 200, chat.text
    event_id = str(uuid.uuid4())
    followup = {
        "event_id": event_id,
        "kind": "followup_message",
        "session_id": session_id,
        "request_id": request_id,
        "message": f"still broken, same error in {followup_marker}",
    }
    feedback = httpx.post(
        f"{loop.url}/v1/feedback",
        json={"events": [followup]},
        headers={"Authorization": f"Bearer {key}", **(privacy if feedback_header else {})},
        timeout=30,
    )
    assert feedback.status_code == 202, feedback.text
    return PrivateSession(
        name, session_id, request_id, prompt_marker, followup_marker, event_id, private
    )


def end_offsets(bootstrap: str) -> dict[TopicPartition, int]:
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        partitions = [
            TopicPartition(topic, partition)
            for topic in TOPICS
            for partition in consumer.partitions_for_topic(topic) or ()
        ]
        return dict(consumer.end_offsets(partitions))
    finally:
        consumer.close()


def read_every_topic(
    bootstrap: str, since: dict[TopicPartition, int], event_ids: set[str], timeout: float = 30
) -> list[bytes]:
    """Every message on every topic since `since`, until the given events have all arrived
    and the topics' ends (at that moment) are reached."""
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        consumer.assign(list(since))
        for partition, offset in since.items():
            consumer.seek(partition, offset)
        messages: list[bytes] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=200).values():
                messages += [(record.key or b"") + b" " + record.value for record in records]
            if all(any(eid.encode() in m for m in messages) for eid in event_ids):
                ends = consumer.end_offsets(list(since))
                if all(consumer.position(tp) >= end for tp, end in ends.items()):
                    return messages
        raise AssertionError(f"not every feedback event reached Kafka within {timeout:.0f} s")
    finally:
        consumer.close()


def rows_containing(engine: Engine, needle: str) -> list[str]:
    """Every row of every table whose text form contains `needle`."""
    found = []
    with engine.connect() as conn:
        for table in inspect(conn).get_table_names():
            query = text(f'SELECT t::text FROM "{table}" t WHERE strpos(t::text, :needle) > 0')
            found += [f"{table}: {row}" for (row,) in conn.execute(query, {"needle": needle})]
    return found


def stored_verdicts(engine: Engine, event_ids: list[str]) -> dict[str, bool | None]:
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT event_id::text, dissatisfied FROM feedback_events "
                "WHERE event_id::text = ANY(:ids)"
            ),
            {"ids": event_ids},
        )
        return {event_id: dissatisfied for event_id, dissatisfied in rows}


def test_private_text_never_reaches_kafka_or_postgres_whichever_call_says_private(
    loop: Loop,
) -> None:
    privacy_key = make_key(loop.engine, Role.ide, privacy_mode=True)
    since = end_offsets(loop.settings.kafka_bootstrap_servers)

    ide = loop.ide_key
    sessions = [
        work(loop, "chat", ide, chat_header=True, feedback_header=False, private=True),
        work(loop, "feedback", ide, chat_header=False, feedback_header=True, private=False),
        work(loop, "both", ide, chat_header=True, feedback_header=True, private=True),
        work(loop, "key", privacy_key, chat_header=False, feedback_header=False, private=True),
    ]

    event_ids = {s.followup_event_id for s in sessions}
    messages = read_every_topic(loop.settings.kafka_bootstrap_servers, since, event_ids)
    wait_until(
        lambda: len(stored_verdicts(loop.engine, list(event_ids))) == len(event_ids),
        60,
        "the worker to store every follow-up",
    )
    verdicts = stored_verdicts(loop.engine, list(event_ids))
    for s in sessions:
        private_markers = [s.followup_marker] + ([s.prompt_marker] if s.private_completion else [])
        for needle in private_markers:
            assert not [m for m in messages if needle.encode() in m], (s.name, needle)
            assert rows_containing(loop.engine, needle) == [], (s.name, needle)
        assert verdicts[s.followup_event_id] is True, s.name
    # The one public completion's prompt was logged: the markers would have been seen.
    public = sessions[1]
    assert any(public.prompt_marker.encode() in m for m in messages)
    wait_until(
        lambda: rows_containing(loop.engine, public.prompt_marker) != [],
        60,
        "the public prompt to be stored",
    )
