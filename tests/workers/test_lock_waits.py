"""A lock another transaction holds is waited for, never taken for poison.

Through the session's Kafka and Postgres: a worker whose batch meets a table lock, the erasure
lock or a row another transaction is writing stores the batch whole once the lock is free,
and sends nothing to the DLQ; a partition change that meets an open export gives up and
lets the inserts queued behind it through.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import date
from typing import Any

import pytest
from kafka import KafkaConsumer, TopicPartition
from prometheus_client import REGISTRY
from sqlalchemy import Connection, Engine, text

from app.events import CompletionEvent
from app.history.erasure import ERASURE_LOCK
from app.history.partitions import (
    PartitionsBusy,
    create_partitions,
    drop_partition,
    list_partitions,
)
from rtrl.embedded.stack import EmbeddedStack
from workers.config import WorkerConfig
from workers.repository import insert_samples
from workers.store import sample_row

HOLD_S = 3.0
"""How long a lock stays held once the worker meets it: past the test's statement timeout."""


def lock_wait_retries() -> float:
    return REGISTRY.get_sample_value("rtrl_worker_lock_wait_retries_total") or 0.0


def blocked_by(engine: Engine, pid: int) -> int:
    """How many sessions wait for a lock the session `pid` holds."""
    with engine.connect() as conn:
        return conn.execute(
            text("SELECT count(*) FROM pg_stat_activity WHERE :pid = ANY(pg_blocking_pids(pid))"),
            {"pid": pid},
        ).scalar_one()


@contextmanager
def holding(engine: Engine, take: Callable[[Connection], object]) -> Iterator[int]:
    """A transaction that takes a lock with `take` and holds it until the block ends; its pid."""
    with engine.connect() as conn:
        transaction = conn.begin()
        take(conn)
        try:
            yield conn.execute(text("SELECT pg_backend_pid()")).scalar_one()
        finally:
            transaction.rollback()


def committed(stack: EmbeddedStack, config: WorkerConfig) -> int:
    """How many messages of its two topics the worker's group has committed."""
    consumer = KafkaConsumer(
        bootstrap_servers=stack.kafka.url, group_id=config.group_id, enable_auto_commit=False
    )
    try:
        return sum(
            consumer.committed(TopicPartition(topic, n)) or 0
            for topic in (config.completions_topic, config.feedback_topic)
            for n in consumer.partitions_for_topic(topic) or ()
        )
    finally:
        consumer.close()


def dlq_size(stack: EmbeddedStack, config: WorkerConfig) -> int:
    """The DLQ's end offsets: 0 while it is empty."""
    consumer = KafkaConsumer(bootstrap_servers=stack.kafka.url)
    try:
        partitions = [
            TopicPartition(config.dlq_topic, n)
            for n in consumer.partitions_for_topic(config.dlq_topic) or ()
        ]
        return sum(consumer.end_offsets(partitions).values())
    finally:
        consumer.close()


def lock_table(conn: Connection, completion: CompletionEvent) -> None:
    conn.execute(text("LOCK TABLE feedback_events IN ACCESS EXCLUSIVE MODE"))


def lock_erasure(conn: Connection, completion: CompletionEvent) -> None:
    # What an erasure takes while it deletes a user's rows.
    conn.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ERASURE_LOCK)


def write_its_row(conn: Connection, completion: CompletionEvent) -> None:
    # Another worker storing the same completion (a redelivery after a rebalance).
    insert_samples(conn, [sample_row(completion) | {"kafka_partition": 0}])


@pytest.mark.parametrize(
    ("take", "lock_timeout_s"),
    [
        pytest.param(lock_table, 0.2, id="a table lock"),
        pytest.param(lock_erasure, 0.2, id="the erasure lock"),
        # Waited for longer than the statement timeout: that timeout fires in the wait.
        pytest.param(write_its_row, 30.0, id="a row another transaction writes"),
    ],
)
def test_a_batch_that_meets_a_held_lock_is_stored_whole_once_it_is_free(
    take: Callable[[Connection, CompletionEvent], None],
    lock_timeout_s: float,
    events: Any,
    worker_config: WorkerConfig,
    worker_engine: Engine,
    publish: Any,
    worker_thread: Any,
    read_rewards: Any,
    wait_for: Any,
    stack: EmbeddedStack,
) -> None:
    # One session, so the batch is one partition's and goes to Postgres as one transaction.
    completion = events.completion(1, session=0)
    publish(completion, events.accepted(1, session=0), events.completion(2, session=0))
    retries = lock_wait_retries()
    with holding(worker_engine, lambda conn: take(conn, completion)) as holder:
        worker_thread(
            config=dataclasses.replace(
                worker_config, statement_timeout_s=1.0, lock_timeout_s=lock_timeout_s
            )
        )
        wait_for(
            lambda: lock_wait_retries() > retries or blocked_by(worker_engine, holder) > 0,
            60,
            "the worker to meet the lock",
        )
        time.sleep(HOLD_S)
        assert read_rewards(events.prefix) == {}

    wait_for(lambda: len(read_rewards(events.prefix)) == 2, 60, "both rewards")
    assert read_rewards(events.prefix)[events.request(1)].components["accepted"] is True
    wait_for(lambda: committed(stack, worker_config) == 3, 30, "the batch's offsets")
    assert dlq_size(stack, worker_config) == 0
    assert lock_wait_retries() > retries


FAR_DAY = date(2099, 12, 31)


@pytest.fixture
def far_day(worker_engine: Engine) -> Iterator[date]:
    """A day no partition exists for; its partitions are dropped after the test."""
    yield FAR_DAY
    with worker_engine.begin() as conn:
        for table in ("rewards", "feedback_events", "samples"):
            for partition in list_partitions(conn, table):
                if partition.day == FAR_DAY:
                    drop_partition(conn, table, partition.name)


def test_a_partition_change_behind_an_open_export_gives_up_and_lets_inserts_through(
    far_day: date, worker_engine: Engine, events: Any, wait_for: Any
) -> None:
    outcome: list[BaseException | list[str]] = []

    def maintain() -> None:
        try:
            with worker_engine.begin() as conn:
                outcome.append(create_partitions(conn, [far_day], lock_timeout_s=1.0, tries=2))
        except BaseException as exc:
            outcome.append(exc)

    # An export reading samples in a transaction it keeps open.
    with holding(
        worker_engine, lambda conn: conn.execute(text("SELECT count(*) FROM samples"))
    ) as export:
        change = threading.Thread(target=maintain)
        change.start()
        wait_for(lambda: blocked_by(worker_engine, export) > 0, 30, "the change to wait")
        # A worker's insert, queued behind the change's request for the table.
        with worker_engine.connect() as conn, conn.begin() as transaction:
            conn.execute(text("SET LOCAL lock_timeout = '20s'"))
            assert insert_samples(conn, [sample_row(events.completion(1))]) == {events.request(1)}
            transaction.rollback()
        change.join(timeout=60)
    assert isinstance(outcome[0], PartitionsBusy)
    assert "2 tries" in str(outcome[0])

    with worker_engine.begin() as conn:
        created = create_partitions(conn, [far_day])
    assert created == [f"{table}_p20991231" for table in ("samples", "feedback_events", "rewards")]
