"""A reward does not depend on the order its events arrive in, nor on how often they arrive.

Generated agent runs (one to three turns) and their feedback go through the real broker and the
worker's own batch handling into Postgres, permuted, duplicated and split into batches at
random; once the sweep has passed, the stored record must be the one the reward functions
give for the whole set of events at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kafka import KafkaConsumer, KafkaProducer
from sqlalchemy import Engine, func, select

from app.config import Settings
from app.events import (
    CompletionEvent,
    EditAccepted,
    EditRejected,
    EditSurvival,
    FollowupMessage,
    SessionEnd,
    encode,
)
from app.signals.rewards import Feedback, distil_components, finalize_reason, run_rewards
from rtrl.embedded.stack import EmbeddedStack
from tests.conftest import fresh_worker_config
from workers.config import WorkerConfig
from workers.consumer import consume_batch, make_consumer, make_producer
from workers.repository import feedback_events, rewards, samples
from workers.sweep import finalize_due_rewards

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
HORIZON_S = 900.0
MESSAGES = ["thanks, that works", "still broken", "revert that", None]


class Stream:
    """The test's own topics and consumer, driven batch by batch as the worker drives them."""

    def __init__(self, stack: EmbeddedStack, engine: Engine) -> None:
        self.config: WorkerConfig = fresh_worker_config(stack.kafka.url, partitions=1)
        settings_ = Settings(kafka_bootstrap_servers=stack.kafka.url)
        self.engine = engine
        self.consumer: KafkaConsumer = make_consumer(settings_, self.config)
        self.consumer.subscribe([self.config.completions_topic, self.config.feedback_topic])
        self.dead_letters: KafkaProducer = make_producer(settings_)
        self.producer = KafkaProducer(
            bootstrap_servers=stack.kafka.url, acks="all", enable_idempotence=True
        )
        deadline = time.monotonic() + 60
        while len(self.consumer.assignment()) < 2:
            assert time.monotonic() < deadline, "the test consumer got no partitions"
            self.consumer.poll(timeout_ms=200)

    def deliver(self, batch: list[CompletionEvent | Feedback]) -> None:
        """Publish one batch and have the worker's code store all of it."""
        for event in batch:
            topic = (
                self.config.completions_topic
                if isinstance(event, CompletionEvent)
                else self.config.feedback_topic
            )
            self.producer.send(topic, key=event.session_id.encode(), value=encode(event))
        self.producer.flush()
        stored, deadline = 0, time.monotonic() + 30
        while stored < len(batch):
            assert time.monotonic() < deadline, "the batch never came back from the broker"
            stored += consume_batch(
                self.consumer, self.dead_letters, self.engine, self.config, threading.Event()
            )

    def close(self) -> None:
        self.consumer.close(autocommit=False)
        self.producer.close(timeout=5)
        self.dead_letters.close(timeout=5)


@pytest.fixture(scope="module")
def stream(stack: EmbeddedStack, engine: Engine) -> Iterator[Stream]:
    opened = Stream(stack, engine)
    yield opened
    opened.close()


def signals_for(draw: st.DrawFn, session: str, request: str, start_s: float) -> list[Feedback]:
    """A plausible set of IDE signals for one completion served at `start_s`."""

    def at(seconds: float) -> dict[str, Any]:
        return {
            "session_id": session,
            "request_id": request,
            "occurred_at": T0 + timedelta(seconds=start_s + seconds),
        }

    feedback: list[Feedback] = []
    if draw(st.booleans()):
        feedback.append(EditAccepted(**at(draw(st.integers(1, 20)))))
    if draw(st.booleans()):
        feedback.append(EditRejected(**at(draw(st.integers(1, 20)))))
    for elapsed in draw(st.lists(st.sampled_from([30.0, 120.0, 300.0, HORIZON_S]), unique=True)):
        share = draw(st.sampled_from([0.0, 0.4, 1.0]))
        feedback.append(EditSurvival(**at(20 + elapsed), elapsed_s=elapsed, surviving_share=share))
    for offset in draw(st.lists(st.integers(25, 600), max_size=2, unique=True)):
        feedback.append(
            FollowupMessage(
                **at(offset), message=draw(st.sampled_from(MESSAGES)), dissatisfied=False
            )
        )
    return feedback


@st.composite
def agent_runs(draw: st.DrawFn) -> tuple[list[CompletionEvent], list[Feedback]]:
    """An agent run of one to three turns and a plausible set of IDE signals for each."""
    ids = uuid.uuid4().hex[:12]
    session = f"order-{ids}-s"
    edit_requested = draw(st.booleans())
    turns, feedback = [], []
    count = draw(st.integers(1, 3))
    for index in range(count):
        request = f"order-{ids}-r{index}"
        # A turn before the last may only read or run tests: no edit, nothing to accept.
        reads = index < count - 1 and draw(st.booleans())
        turns.append(
            CompletionEvent(
                session_id=session,
                request_id=request,
                occurred_at=T0 + timedelta(seconds=10 * index),
                checkpoint="ckpt-order",
                user_hash="u-order",
                edit_requested=edit_requested,
                proposed_edit=not reads and draw(st.booleans()),
                trajectory_id=f"order-{ids}-r0",
                turn_index=index,
                parent_request_id=f"order-{ids}-r{index - 1}" if index else None,
                ttft_ms=draw(st.sampled_from([80.0, 1500.0])),
                latency_ms=2500.0,
                completion_tokens=draw(st.sampled_from([1, 40])),
            )
        )
        if not reads:
            feedback += signals_for(draw, session, request, 10 * index)
    if draw(st.booleans()):
        ended = T0 + timedelta(seconds=draw(st.integers(30, 1000)))
        feedback.append(
            SessionEnd(session_id=session, request_id=turns[-1].request_id, occurred_at=ended)
        )
    return turns, feedback


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(run=agent_runs(), data=st.data())
def test_any_order_and_duplication_of_an_agent_runs_events_gives_the_same_rewards(
    stream: Stream, run: tuple[list[CompletionEvent], list[Feedback]], data: st.DataObject
) -> None:
    turns, feedback = run
    everything: list[CompletionEvent | Feedback] = [*turns, *feedback]
    redelivered = data.draw(st.lists(st.sampled_from(everything), max_size=3))
    arrivals = data.draw(st.permutations([*everything, *redelivered]))
    # Each gap between two arrivals may end a batch: one event per batch up to one batch.
    gaps = data.draw(
        st.lists(st.booleans(), min_size=len(arrivals) - 1, max_size=len(arrivals) - 1)
    )
    cuts = [index + 1 for index, cut in enumerate(gaps) if cut]
    for start, end in zip([0, *cuts], [*cuts, len(arrivals)], strict=True):
        stream.deliver(arrivals[start:end])
    # Whatever the stream left open is finalized by time, as the sweep does in production.
    later = datetime.now(UTC) + timedelta(days=1)
    finalize_due_rewards(stream.engine, stream.config, now=later)

    config = stream.config
    expected = [
        distil_components(
            turn,
            feedback,
            horizon_s=config.horizon_s,
            latency_budget_ms=config.latency_budget_ms,
            ttft_budget_ms=config.ttft_budget_ms,
            tpot_budget_ms=config.tpot_budget_ms,
        )
        for turn in turns
    ]
    expected_rewards = run_rewards(expected, config.reward_version)
    with stream.engine.connect() as conn:
        for turn, components, reward in zip(turns, expected, expected_rewards, strict=True):
            stored = conn.execute(
                select(rewards)
                .join(samples, samples.c.id == rewards.c.sample_id)
                .where(samples.c.request_id == turn.request_id)
            ).all()
            assert len(stored) == 1, "one reward record per completion"
            (record,) = stored
            assert record.components == components.model_dump(mode="json")
            assert record.reward == (reward if reward is None else pytest.approx(reward))
            assert record.finalize_reason == finalize_reason(
                turn, feedback, horizon_s=config.horizon_s, grace_s=config.grace_s, now=later
            )
        feedback_rows = conn.scalar(
            select(func.count()).where(feedback_events.c.session_id == turns[0].session_id)
        )
    assert feedback_rows == len(feedback), "each feedback event stored once"
