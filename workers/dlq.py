"""Re-driving dead letters: `rtrl dlq replay` sends the messages the DLQ holds back to the
topics they came from, each once.

A dead letter (`app.events.DeadLetter`) names the topic, partition and offset of its message,
the message's key and its payload. A replay reads the DLQ as a consumer group of its own
(`REPLAY_GROUP`), from where the last replay stopped to where the topic ended when this one
started. It sends each letter's payload to its topic and partition, so a session's events stay
on one partition number, and commits the group's offsets once the broker has acknowledged
every message sent (`acks=all`): a second replay re-drives nothing the first did. Should a
replay die between the two, its next run sends those messages again, and the workers, whose
writes are idempotent, store them once.

A letter that does not carry its whole message cannot be replayed; it is counted, with why,
and passed over: a privacy-mode message (only its ids were kept), a message cut to the size a
dead letter takes, an event the gateway could not send for its size (only its ids), a
message of a topic the workers do not read.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata
from pydantic import ValidationError

from app.config import Settings
from app.events import DeadLetter
from app.kafka.clients import COMPRESSION, kafka_client, kafka_security
from workers.config import WorkerConfig
from workers.consumer import CUT_NOTE, PRIVATE_NOTE, Record

REPLAY_GROUP = "rtrl-dlq-replay"
"""The consumer group whose committed offsets say how far replays have read the DLQ."""
REPLAYED_FROM = "rtrl-replayed-from"
"""Header of a re-driven message: the DLQ topic, partition and offset of its letter."""
POLL_RECORDS = 500
"""Letters sent, then committed, at a time."""
IDLE_POLLS = 10
"""Empty polls (of 1 s) in a row after which a replay stops, its end not reached."""


class ReplayError(RuntimeError):
    """A replay could not go on; the message says why and how far it got."""


@dataclass
class Replay:
    """What one replay did, or with `dry_run` would do."""

    read: int = 0
    """Letters read (every one counted once below, in `passed_over` or by its reason)."""
    redriven: Counter[str] = field(default_factory=Counter)
    """Messages sent back, by topic (with `dry_run`: that would be)."""
    not_replayable: Counter[str] = field(default_factory=Counter)
    """Letters passed over, by why they cannot be replayed."""
    passed_over: int = 0
    """Letters dead-lettered before `since`, passed over."""
    reasons: Counter[str] = field(default_factory=Counter)
    """Why the letters read were dead-lettered, by kind (`reason_kind`)."""
    examples: dict[str, str] = field(default_factory=dict)
    """One full reason of each kind."""
    left: int = 0
    """Letters left for the next replay: past `limit`, or dead-lettered since this one began."""
    stopped_at_limit: bool = False

    def line(self) -> str:
        """How far the run got, in one line."""
        return (
            f"{self.read} letters read: {sum(self.redriven.values())} re-driven,"
            f" {sum(self.not_replayable.values())} not replayable,"
            f" {self.passed_over} from before --since"
        )


def reason_kind(reason: str) -> str:
    """A reason's first clause, alike for every letter of its kind ("invalid", "over the
    worker's time budget", "over the size Kafka takes", ...)."""
    head = re.sub(r"^\d+ bytes: ", "", reason)
    return re.split(r":| \(", head, maxsplit=1)[0].strip()


def why_not_replayable(letter: DeadLetter, config: WorkerConfig) -> str | None:
    """Why a letter cannot be re-driven (it does not carry its whole message), or None."""
    if letter.source_topic not in (config.completions_topic, config.feedback_topic):
        return f"from {letter.source_topic}, which the workers do not read"
    if letter.offset < 0:
        return "never in Kafka (over the size it takes): only its ids were kept"
    if PRIVATE_NOTE in letter.reason:
        return "privacy mode: only its ids were kept"
    if CUT_NOTE in letter.reason:
        return "cut to the size of a dead letter: only its start was kept"
    if not letter.payload:
        return "an empty message"
    return None


def replay_dead_letters(
    settings: Settings,
    config: WorkerConfig,
    *,
    group_id: str = REPLAY_GROUP,
    since: datetime | None = None,
    limit: int | None = None,
    dry_run: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Replay:
    """Send the messages of the dead letters no replay of `group_id` has read back to their
    topics (at most `limit`; letters dead-lettered before `since` are passed over); with
    `dry_run`, only count them and send or commit nothing.

    The run reads each partition of the DLQ up to its end, and stops short of a letter
    dead-lettered after the run began (a re-driven message refused again, say): that one is
    the next run's.
    """
    began = datetime.now(UTC)
    reader = _make_reader(settings, group_id)
    writer = None if dry_run else _make_writer(settings)
    try:
        next_offsets = _start(reader, config, check_sources=not dry_run)
        report = Replay()
        reading = set(next_offsets)
        idle = 0
        while reading and not report.stopped_at_limit and idle < IDLE_POLLS:
            polled = reader.poll(timeout_ms=1000, max_records=POLL_RECORDS)
            idle = 0 if polled else idle + 1
            handled: dict[TopicPartition, int] = {}
            sends: list[tuple[TopicPartition, int, Any]] = []
            for tp, records in polled.items():
                for record in records:
                    if limit is not None and sum(report.redriven.values()) >= limit:
                        report.stopped_at_limit = True
                    letter = _letter(record)
                    if report.stopped_at_limit or (letter is not None and letter.failed_at > began):
                        reading.discard(tp)
                        break
                    sent = _handle(record, letter, config, report, writer, since, dry_run)
                    if sent is not None:
                        sends.append((tp, record.offset, sent))
                    handled[tp] = next_offsets[tp] = record.offset + 1
            _confirm(writer, sends)
            if not dry_run and handled:
                reader.commit({tp: OffsetAndMetadata(n, "", -1) for tp, n in handled.items()})
            for tp in list(reading):
                highwater = reader.highwater(tp)
                if highwater is not None and reader.position(tp) >= highwater:
                    reading.discard(tp)
            reader.pause(*[tp for tp in next_offsets if tp not in reading])
            if progress is not None and polled:
                progress(report.line())
        report.left = sum(
            max(0, (reader.highwater(tp) or offset) - offset) for tp, offset in next_offsets.items()
        )
        return report
    finally:
        reader.close(autocommit=False)
        if writer is not None:
            writer.close(timeout=10)


def _start(
    reader: KafkaConsumer, config: WorkerConfig, *, check_sources: bool
) -> dict[TopicPartition, int]:
    """Assign every partition of the DLQ, each at the group's committed offset (or its
    start); those offsets."""
    topics = reader.topics()
    needed = [config.dlq_topic] + (
        [config.completions_topic, config.feedback_topic] if check_sources else []
    )
    missing = [topic for topic in needed if topic not in topics]
    if missing:
        raise ReplayError(f"topics {', '.join(missing)} do not exist; `rtrl migrate` creates them")
    partitions = [
        TopicPartition(config.dlq_topic, n)
        for n in sorted(reader.partitions_for_topic(config.dlq_topic) or ())
    ]
    reader.assign(partitions)
    starts = reader.beginning_offsets(partitions)
    offsets = {}
    for tp in partitions:
        committed = reader.committed(tp)
        offsets[tp] = starts[tp] if committed is None else max(committed, starts[tp])
        reader.seek(tp, offsets[tp])
    return offsets


def _letter(record: Record) -> DeadLetter | None:
    try:
        return DeadLetter.model_validate_json(record.value or b"")
    except ValidationError:
        return None


def _handle(
    record: Record,
    letter: DeadLetter | None,
    config: WorkerConfig,
    report: Replay,
    writer: KafkaProducer | None,
    since: datetime | None,
    dry_run: bool,
) -> Any:
    """Judge one letter and count it; the send's future when its message was sent."""
    report.read += 1
    if letter is None:
        report.not_replayable["not a dead letter"] += 1
        return None
    if since is not None and letter.failed_at < since:
        report.passed_over += 1
        return None
    kind = reason_kind(letter.reason)
    report.reasons[kind] += 1
    report.examples.setdefault(kind, letter.reason)
    why = why_not_replayable(letter, config)
    if why is not None:
        report.not_replayable[why] += 1
        return None
    report.redriven[letter.source_topic] += 1
    if dry_run or writer is None:
        return None
    partitions = writer.partitions_for(letter.source_topic) or set()
    return writer.send(
        letter.source_topic,
        key=letter.key.encode() if letter.key is not None else None,
        value=letter.payload.encode(),
        # Its own partition, beside the rest of its session (a topic that has since lost
        # partitions has its key choose).
        partition=letter.partition if letter.partition in partitions else None,
        headers=[(REPLAYED_FROM, f"{record.topic}/{record.partition}/{record.offset}".encode())],
    )


def _confirm(
    writer: KafkaProducer | None, sends: Sequence[tuple[TopicPartition, int, Any]]
) -> None:
    """Wait until the broker has every message sent; raises ReplayError if it refused one
    (nothing of this poll is committed, so the next replay sends it again)."""
    if writer is None or not sends:
        return
    writer.flush()
    for tp, offset, future in sends:
        try:
            future.get(timeout=30)
        except Exception as exc:
            raise ReplayError(
                f"the message of the letter at {tp.topic}[{tp.partition}]@{offset} was not "
                f"delivered ({type(exc).__name__}: {exc}); run the replay again"
            ) from exc


def _make_reader(settings: Settings, group_id: str) -> KafkaConsumer:
    return kafka_client(
        KafkaConsumer,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        group_id=group_id,
        client_id="rtrl-dlq-replay",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        # A letter is as large as the topics take (`rtrl migrate`).
        max_partition_fetch_bytes=settings.kafka_max_message_bytes,
        bootstrap_timeout_ms=10_000,
        **kafka_security(settings),
    )


def _make_writer(settings: Settings) -> KafkaProducer:
    return kafka_client(
        KafkaProducer,
        bootstrap_servers=settings.kafka_bootstrap_servers,
        client_id="rtrl-dlq-replay",
        max_request_size=settings.kafka_max_message_bytes,
        acks="all",
        enable_idempotence=True,
        compression_type=COMPRESSION,
        linger_ms=5,
        **kafka_security(settings),
    )
