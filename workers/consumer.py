"""The reward worker: a Kafka consumer-group process that distils events into Postgres.

Each poll is one batch: decode → validate → store (one transaction) → flush dead letters →
commit offsets. Writes are idempotent and offsets are committed only after the database,
so a crash or a rebalance re-delivers a batch without losing or duplicating anything.
"""

from __future__ import annotations

import gc
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, NamedTuple, Protocol

import orjson
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.coordinator.assignors.range import RangePartitionAssignor
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata
from psycopg.errors import DeadlockDetected, LockNotAvailable, QueryCanceled
from pydantic import ValidationError
from sqlalchemy import Engine, text
from sqlalchemy.exc import DataError, IntegrityError, OperationalError
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    retry_if_exception_type,
    wait_exponential,
)

from app.abtest.guardrails import check_guardrails
from app.config import Settings
from app.events import DeadLetter, decode_completion, decode_feedback, encode
from app.heartbeat import Heartbeat
from app.kafka.clients import COMPRESSION, kafka_client, kafka_security
from app.kafka.topic_ids import TopicIds
from app.kafka.topics import check_topic_durability
from app.signals.rewards import reward_open_limit, reward_weights
from workers.config import WorkerConfig
from workers.metrics import (
    BATCH_SECONDS,
    CONSUMER_LAG,
    DEAD_LETTERS,
    LOCK_WAIT_RETRIES,
    MESSAGES,
    REWARDS_OVERDUE,
    REWARDS_SWEPT,
)
from workers.monitors import check_running_experiments
from workers.recreated_topics import RecreatedTopics
from workers.repository import (
    feedback_events,
    lock_partitions,
    make_worker_engine,
    samples,
    unstorable,
)
from workers.store import feedback_row, sample_row, store_events
from workers.sweep import finalize_due_rewards, overdue_seconds
from workers.watermarks import StreamWatermarks

log = logging.getLogger(__name__)

REASON_MAX_CHARS = 2000
PAYLOAD_MAX_CHARS = 256 * 1024
"""A dead letter carries at most this much of its message (the whole stays at its offset in
the source topic), so it never outgrows what the broker takes."""
PRIVATE_IDS = ("event_id", "session_id", "request_id", "privacy")
PRIVATE_NOTE = "(privacy mode: content dropped)"
"""Ends the reason of a dead letter that kept only its message's ids."""
CUT_NOTE = "(payload cut from "
"""Opens the note on a dead letter that kept only the start of its message."""
LOCK_RETRY_MAX_WAIT_S = 10.0
"""The longest pause before a batch that waited in vain for a lock is stored again."""
ROW_LOCK_WAIT = re.compile(r"^while [^\n]*tuple[^\n]* in relation ", re.MULTILINE)
"""How Postgres names a wait for a row that another transaction is writing (the error
context of its transaction-lock wait): a statement timeout that fires there was a lock
wait, not work."""


class Record(Protocol):
    """What the worker reads of a Kafka `ConsumerRecord`."""

    @property
    def topic(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...


class Accepted(NamedTuple):
    """A message that decoded and validated, with the row it becomes."""

    record: Record
    row: dict[str, Any]


@dataclass
class Batch:
    """One poll's messages, sorted into rows to store and dead letters."""

    samples: list[Accepted] = field(default_factory=list)
    feedback: list[Accepted] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)


def dead_letter(record: Record, reason: str) -> DeadLetter:
    """A dead letter carrying the original message and why it was not processed.

    A privacy-mode message keeps only its ids: its content must not survive in the DLQ.
    """
    payload = (record.value or b"").decode("utf-8", errors="replace")
    private = _private_ids(record.value)
    if private is not None:
        payload, reason = private, f"{reason} {PRIVATE_NOTE}"
    elif len(payload) > PAYLOAD_MAX_CHARS:
        reason = (
            f"{reason} {CUT_NOTE}{len(record.value or b'')} bytes to its first"
            f" {PAYLOAD_MAX_CHARS} characters; the whole message stays at its offset)"
        )
        payload = payload[:PAYLOAD_MAX_CHARS]
    if len(reason) > REASON_MAX_CHARS:
        reason = reason[: REASON_MAX_CHARS - 1] + "…"
    return DeadLetter(
        source_topic=record.topic,
        partition=record.partition,
        offset=record.offset,
        key=record.key.decode("utf-8", errors="replace") if record.key is not None else None,
        payload=payload,
        reason=reason,
    )


def _private_ids(value: bytes | None) -> str | None:
    try:
        message = orjson.loads(value or b"")
    except orjson.JSONDecodeError:
        return None
    if not isinstance(message, dict) or message.get("privacy") is not True:
        return None
    return orjson.dumps({k: message.get(k) for k in PRIVATE_IDS}).decode()


def why_invalid(exc: ValueError) -> str:
    """The validation errors by field, without the input values (they may be private)."""
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, error['loc'])) or 'message'}: {error['msg']}"
            for error in exc.errors(include_input=False, include_url=False)
        )
    return str(exc)


class InvalidMessage(Exception):
    """A message the worker cannot store; the text says why."""


def decode_batch(records: Iterable[Record], config: WorkerConfig) -> Batch:
    """Decode and validate each message into a row, or a dead letter saying why not."""
    batch = Batch()
    for record in records:
        try:
            accepted = Accepted(record, row_of(record, config))
        except InvalidMessage as exc:
            batch.dead_letters.append(dead_letter(record, str(exc)))
            continue
        except Exception as exc:  # a message the worker's own code fails on: never a crash loop
            log.exception("message %s[%d]@%d failed", record.topic, record.partition, record.offset)
            batch.dead_letters.append(dead_letter(record, f"failed: {type(exc).__name__}: {exc}"))
            continue
        if record.topic == config.completions_topic:
            batch.samples.append(accepted)
        else:
            batch.feedback.append(accepted)
    return batch


def row_of(record: Record, config: WorkerConfig) -> dict[str, Any]:
    """The row a message becomes; raises InvalidMessage when it cannot be stored."""
    if not record.value:
        raise InvalidMessage("empty message")
    try:
        if record.topic == config.completions_topic:
            table, row = samples, sample_row(decode_completion(record.value))
            row["kafka_partition"] = record.partition
        elif record.topic == config.feedback_topic:
            table, row = feedback_events, feedback_row(decode_feedback(record.value))
        else:
            raise InvalidMessage(f"unexpected topic {record.topic}")
    except ValueError as exc:
        raise InvalidMessage(f"undecodable: {why_invalid(exc)}") from None
    problem = unstorable(table, row)
    if problem is not None:
        raise InvalidMessage(f"invalid: {problem}")
    return row


def store_batch(
    engine: Engine,
    batch: Batch,
    config: WorkerConfig,
    stop_event: threading.Event | None = None,
) -> list[DeadLetter]:
    """Store a batch in one transaction; the messages that cannot be stored become dead letters.

    A batch Postgres rejects (a row that passed validation and still fails), that overruns
    the time budget (`WorkerConfig.statement_timeout_s`) or that makes the worker's code raise
    is stored again in halves, down to the one message at fault, so that no message stalls
    the stream and the others are stored as they would have been. A lock another
    transaction holds is no message's fault: the batch waits for it whole
    (`store_when_unlocked`), and the lock error is raised only once `stop_event` is set.
    """
    messages = [(True, a) for a in batch.samples] + [(False, a) for a in batch.feedback]
    return _store_bisecting(engine, messages, config, stop_event or threading.Event())


def _store_bisecting(
    engine: Engine,
    messages: Sequence[tuple[bool, Accepted]],
    config: WorkerConfig,
    stop_event: threading.Event,
) -> list[DeadLetter]:
    if not messages:
        return []
    try:
        store_when_unlocked(
            engine,
            [accepted for is_sample, accepted in messages if is_sample],
            [accepted for is_sample, accepted in messages if not is_sample],
            config,
            stop_event,
        )
        return []
    except OperationalError as exc:
        if waited_for_lock(exc) or not isinstance(exc.orig, QueryCanceled):
            # Stopped while waiting for a lock, or the database is unavailable: the caller
            # leaves the batch uncommitted, or waits and stores it again.
            raise
        reason = (
            f"over the worker's time budget: a statement storing it ran past"
            f" {config.statement_timeout_s:g} s"
        )
    except (DataError, IntegrityError) as exc:
        reason = f"rejected by the database: {exc.orig}"
    except Exception as exc:
        log.exception("storing %d messages failed", len(messages))
        reason = f"failed: {type(exc).__name__}: {exc}"
    if len(messages) == 1:
        return [dead_letter(messages[0][1].record, reason)]
    log.warning("a batch of %d not stored (%s); storing it in halves", len(messages), reason)
    half = len(messages) // 2
    return _store_bisecting(engine, messages[:half], config, stop_event) + _store_bisecting(
        engine, messages[half:], config, stop_event
    )


def waited_for_lock(exc: BaseException) -> bool:
    """True when a statement failed for a lock another transaction held, not for its rows.

    Postgres gave up waiting (`lock_timeout`, 55P03), broke a deadlock (40P01), or the
    statement timeout fired while the statement waited for a row another transaction writes.
    """
    if not isinstance(exc, OperationalError):
        return False
    cause = exc.orig
    if isinstance(cause, LockNotAvailable | DeadlockDetected):
        return True
    return isinstance(cause, QueryCanceled) and bool(ROW_LOCK_WAIT.search(cause.diag.context or ""))


def store_when_unlocked(
    engine: Engine,
    sample_rows: Sequence[Accepted],
    feedback: Sequence[Accepted],
    config: WorkerConfig,
    stop_event: threading.Event,
) -> None:
    """Store the messages in one transaction, again after a pause (0.5 s, doubling up to
    `LOCK_RETRY_MAX_WAIT_S`) each time a statement waited in vain for a lock; the lock error
    is raised only once `stop_event` is set."""

    def waiting(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        LOCK_WAIT_RETRIES.inc()
        exc = state.outcome.exception()
        log.warning(
            "a batch of %d waited in vain for a lock another transaction holds (%s); "
            "storing it again in %.1f s",
            len(sample_rows) + len(feedback),
            getattr(exc, "orig", exc),
            state.next_action.sleep,
        )

    def pause(seconds: float) -> None:
        stop_event.wait(seconds)  # a stop cuts the wait short

    retrying = Retrying(
        retry=retry_if_exception(waited_for_lock),
        wait=wait_exponential(multiplier=0.5, max=LOCK_RETRY_MAX_WAIT_S),
        stop=lambda state: stop_event.is_set(),
        sleep=pause,
        before_sleep=waiting,
        reraise=True,
    )
    retrying(_store, engine, sample_rows, feedback, config)


def _store(
    engine: Engine,
    sample_rows: Sequence[Accepted],
    feedback: Sequence[Accepted],
    config: WorkerConfig,
) -> None:
    with engine.begin() as conn:
        # Waiting for a peer that holds a partition is not this batch's fault: the budgets
        # start once the locks are held. Any other lock is waited for `lock_timeout_s` at
        # most, a few seconds, so that a lock wait ends as a lock error and is never taken
        # for a statement that overran the time budget.
        lock_partitions(conn, {a.record.partition for a in [*sample_rows, *feedback]})
        conn.execute(
            text(
                "SELECT set_config('lock_timeout', :lock_ms, true),"
                " set_config('statement_timeout', :statement_ms, true)"
            ),
            {
                "lock_ms": _milliseconds(config.lock_timeout_s),
                "statement_ms": _milliseconds(config.statement_timeout_s),
            },
        )
        store_events(
            conn,
            [a.row for a in sample_rows],
            [a.row for a in feedback],
            config,
            now=datetime.now(UTC),
        )


def _milliseconds(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))  # 0 would turn the timeout off


def next_offsets(
    records: Mapping[TopicPartition, Sequence[Record]],
) -> dict[TopicPartition, OffsetAndMetadata]:
    """The offsets to commit once a poll's records are stored: one past the last of each."""
    return {
        partition: OffsetAndMetadata(batch[-1].offset + 1, "", -1)
        for partition, batch in records.items()
        if batch
    }


def make_consumer(settings: Settings, config: WorkerConfig) -> KafkaConsumer:
    """A group member that never auto-commits; range assignment keeps topics co-partitioned."""
    return kafka_client(
        KafkaConsumer,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        group_id=config.group_id,
        client_id="rtrl-worker",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_poll_records=config.max_records,
        session_timeout_ms=config.session_timeout_ms,
        heartbeat_interval_ms=config.heartbeat_interval_ms,
        # First contact only: `connect` retries, saying why, rather than wait 30 s in silence.
        bootstrap_timeout_ms=5000,
        # A session's completion and feedback share partition numbers; range assignment
        # hands the same numbers of both topics to one worker (see repository.lock_partitions).
        partition_assignment_strategy=(RangePartitionAssignor,),
        **kafka_security(settings),
    )


def make_producer(settings: Settings) -> KafkaProducer:
    """The dead-letter producer."""
    return kafka_client(
        KafkaProducer,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="rtrl-worker-dlq",
        # The topics take messages up to this size (`rtrl migrate`); a dead letter is cut
        # well below it (PAYLOAD_MAX_CHARS).
        max_request_size=settings.kafka_max_message_bytes,
        acks="all",
        enable_idempotence=True,
        compression_type=COMPRESSION,
        linger_ms=5,
        **kafka_security(settings),
    )


class TopicMissing(RuntimeError):
    """A topic the worker reads does not exist (yet)."""


def check_copartitioned(consumer: KafkaConsumer, config: WorkerConfig) -> None:
    """Refuse to start unless both topics exist with the same number of partitions."""
    consumer.topics()  # refreshes the metadata partitions_for_topic reads
    counts = {}
    for topic in (config.completions_topic, config.feedback_topic):
        partitions = consumer.partitions_for_topic(topic)
        if not partitions:
            raise TopicMissing(f"topic {topic} does not exist; `rtrl migrate` creates it")
        counts[topic] = len(partitions)
    if len(set(counts.values())) != 1:
        raise RuntimeError(f"topics must have as many partitions as each other: {counts}")


def connect(
    settings: Settings, config: WorkerConfig, stop_event: threading.Event
) -> tuple[KafkaConsumer, KafkaProducer] | None:
    """The group member and the dead-letter producer, once the broker answers and both topics
    exist; None when told to stop first.

    A worker may start before Kafka does, or before `rtrl migrate` created the topics (a
    restarted embedded broker re-creates them just after it opens its port): it waits,
    backing off to 10 s between tries and saying why, rather than exiting. Topics with
    different partition counts are a configuration error and stop it at once.
    """

    def attempt() -> tuple[KafkaConsumer, KafkaProducer]:
        consumer = make_consumer(settings, config)
        try:
            check_copartitioned(consumer, config)
            check_topic_durability(
                settings, (config.completions_topic, config.feedback_topic, config.dlq_topic)
            )
            return consumer, make_producer(settings)
        except BaseException:
            consumer.close(autocommit=False)
            raise

    def waiting(state: RetryCallState) -> None:
        assert state.outcome is not None and state.next_action is not None
        log.warning(
            "Kafka at %s not ready (%s); trying again in %.1f s",
            settings.kafka_bootstrap_servers,
            state.outcome.exception(),
            state.next_action.sleep,
        )

    def pause(seconds: float) -> None:
        stop_event.wait(seconds)  # a stop cuts the wait short

    retrying = Retrying(
        retry=retry_if_exception_type((KafkaError, TopicMissing)),
        wait=wait_exponential(multiplier=0.5, max=10),
        stop=lambda state: stop_event.is_set(),
        sleep=pause,
        before_sleep=waiting,
        retry_error_callback=lambda state: None,
    )
    connected: tuple[KafkaConsumer, KafkaProducer] | None = retrying(attempt)
    return connected


def consume_batch(
    consumer: KafkaConsumer,
    producer: KafkaProducer,
    engine: Engine,
    config: WorkerConfig,
    stop_event: threading.Event,
    watermarks: StreamWatermarks | None = None,
) -> int:
    """Poll one batch and carry it through to committed offsets; returns how many messages."""
    polled = consumer.poll(timeout_ms=config.poll_timeout_ms, max_records=config.max_records)
    if watermarks is not None:
        watermarks.observe(polled)
    records = [record for batch in polled.values() for record in batch]
    if not records:
        return 0
    started = time.perf_counter()
    batch = decode_batch(records, config)
    while True:
        try:
            dead_letters = batch.dead_letters + store_batch(engine, batch, config, stop_event)
            break
        except OperationalError as exc:
            if stop_event.is_set():
                return len(records)  # offsets stay uncommitted: the batch comes back
            log.warning("database unavailable, retrying the batch: %s", exc)
            time.sleep(1.0)
    if not send_dead_letters(producer, config.dlq_topic, dead_letters):
        # Nothing is committed and the batch is read again: a dead letter is never lost.
        for partition, polled_records in polled.items():
            if polled_records:
                consumer.seek(partition, polled_records[0].offset)
        time.sleep(1.0)
        return len(records)
    try:
        consumer.commit(next_offsets(polled))
    except CommitFailedError as exc:
        # The partitions moved to another worker, which re-reads them; writes are idempotent.
        log.info("offsets not committed after a rebalance: %s", exc)
    BATCH_SECONDS.observe(time.perf_counter() - started)
    for partition, polled_records in polled.items():
        MESSAGES.labels(partition.topic).inc(len(polled_records))
    for letter in dead_letters:
        DEAD_LETTERS.labels(letter.source_topic).inc()
    log.debug(
        "batch of %d: %d samples, %d feedback, %d dead letters",
        len(records),
        len(batch.samples),
        len(batch.feedback),
        len(dead_letters),
    )
    return len(records)


def send_dead_letters(producer: KafkaProducer, topic: str, letters: Sequence[DeadLetter]) -> bool:
    """Send the dead letters and wait until the broker has them all; False if it did not take
    one (it is down, or refused it), which the caller answers by reading the batch again."""
    futures = []
    try:
        for letter in letters:
            log.warning(
                "dead letter %s[%d]@%d: %s",
                letter.source_topic,
                letter.partition,
                letter.offset,
                letter.reason[:200],
            )
            futures.append(
                producer.send(
                    topic,
                    key=letter.key.encode() if letter.key is not None else None,
                    value=encode(letter),
                )
            )
        producer.flush()
        for future in futures:
            future.get(timeout=30)
    except KafkaError as exc:
        log.warning("dead letters not delivered, reading the batch again: %s", exc)
        return False
    return True


def run_worker(
    settings: Settings,
    *,
    stop_event: threading.Event | None = None,
    config: WorkerConfig | None = None,
) -> None:
    """Consume completions and feedback until `stop_event` is set; sweep, monitor and check the
    guardrails meanwhile."""
    config = config or WorkerConfig.from_settings(settings)
    reward_weights(config.reward_version)  # an unknown version fails here, not mid-stream
    tune_gc()
    stop_event = stop_event or threading.Event()
    connected = connect(settings, config, stop_event)
    if connected is None:
        log.info("worker stopped before Kafka was ready")
        return
    consumer, producer = connected
    engine = make_worker_engine(settings.database_url)
    topics = (config.completions_topic, config.feedback_topic)
    recreated = RecreatedTopics(
        TopicIds(
            settings.kafka_bootstrap_servers,
            security=kafka_security(settings),
            client_id="rtrl-worker-topics",
        ),
        topics,
    )
    try:
        if config.topic_check_interval_s is not None:
            recreated.check(consumer)  # the logs this worker starts on
        consumer.subscribe(list(topics))
        log.info(
            "worker consuming %s and %s as group %s",
            config.completions_topic,
            config.feedback_topic,
            config.group_id,
        )
        last_sweep = last_monitor = last_guardrails = last_topic_check = time.monotonic()
        heartbeat = Heartbeat(settings.heartbeat_file)
        watermarks = StreamWatermarks()
        while not stop_event.is_set():
            heartbeat.beat()
            consume_batch(consumer, producer, engine, config, stop_event, watermarks)
            record_lag(consumer, topics)
            now = time.monotonic()
            if _due(config.topic_check_interval_s, last_topic_check, now):
                last_topic_check = now
                _run_safely("topic check", partial(recreated.check, consumer))
            # On a timer, under full load too: each owned partition is swept up to how far
            # its stream has been read, so a backlog's feedback is stored before its rewards
            # are frozen, and a peer's partitions are left to the peer.
            if _due(config.sweep_interval_s, last_sweep, now):
                last_sweep = now
                marks = watermarks.by_partition(consumer, topics, datetime.now(UTC))
                _run_safely("sweep", partial(sweep, engine, config, marks))
            if _due(config.monitor_interval_s, last_monitor, now):
                last_monitor = now
                _run_safely(
                    "monitors",
                    lambda: check_running_experiments(engine, window_length=config.monitor_window),
                )
            if _due(config.guardrail_interval_s, last_guardrails, now):
                last_guardrails = now
                _run_safely(
                    "guardrails",
                    lambda: check_guardrails(engine, rollback=True, redis_url=settings.redis_url),
                )
    finally:
        recreated.close()
        consumer.close(autocommit=False)
        producer.close(timeout=10)
        engine.dispose()
        log.info("worker stopped")


def sweep(engine: Engine, config: WorkerConfig, watermarks: Mapping[int, datetime]) -> None:
    """Finalize the owned partitions' due rewards, then measure how late the oldest open is."""
    REWARDS_SWEPT.inc(finalize_due_rewards(engine, config, watermarks=watermarks))
    REWARDS_OVERDUE.set(
        overdue_seconds(engine, datetime.now(UTC), open_limit=open_limit_of(config))
    )


def open_limit_of(config: WorkerConfig) -> timedelta:
    """The longest a reward stays open after its completion was served (`reward_open_limit`)."""
    return reward_open_limit(
        horizon_s=config.survival_horizon.total_seconds(),
        grace_s=config.finalization_grace.total_seconds(),
        max_accept_delay_s=config.max_accept_delay.total_seconds(),
    )


def record_lag(consumer: KafkaConsumer, topics: Sequence[str]) -> None:
    """Messages not yet read on this worker's partitions, per topic (0 when it owns none)."""
    lag = dict.fromkeys(topics, 0)
    for partition in consumer.assignment():
        highwater = consumer.highwater(partition)
        # Without waiting: a partition whose position is not known yet is left out.
        position = consumer.position(partition, timeout_ms=0)
        if partition.topic in lag and highwater is not None and position is not None:
            lag[partition.topic] += max(0, highwater - position)
    for topic, behind in lag.items():
        CONSUMER_LAG.labels(topic).set(behind)


def tune_gc() -> None:
    """Collect cycles less often: a batch makes ~100k short-lived objects (rows, events)."""
    # With the default threshold (700) the collector ran hundreds of times per batch and
    # cost 15-35% of the worker's CPU in bench/workers.py.
    gc.set_threshold(50_000, 50, 100)


def _due(interval_s: float | None, last: float, now: float) -> bool:
    return interval_s is not None and now - last >= interval_s


def _run_safely(name: str, task: Callable[[], object]) -> None:
    # Housekeeping must never stop the stream; it runs again at its next interval.
    try:
        task()
    except Exception:
        log.exception("%s failed; retrying at the next interval", name)
