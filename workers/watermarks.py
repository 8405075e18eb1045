"""How far each partition's stream has been read, in event time: what the sweep may finalize.

A reward is due at horizon + grace after acceptance (event time). Finalizing it by the wall
clock while its partition still has unread messages would freeze it before its feedback is
stored, so each partition number gets a watermark: now when this worker has read every
message of that partition (of both topics), else the produce time of the last message it
read. A partition this worker does not own has none, so it is never swept here.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from datetime import UTC, datetime
from typing import Protocol

from kafka import TopicPartition


class TimedRecord(Protocol):
    @property
    def timestamp(self) -> int: ...


class PartitionOffsets(Protocol):
    """What a watermark needs of a KafkaConsumer."""

    def assignment(self) -> set[TopicPartition]: ...
    def highwater(self, partition: TopicPartition) -> int | None: ...
    def position(self, partition: TopicPartition) -> int | None: ...


class StreamWatermarks:
    """The event time each owned partition number has been read up to."""

    def __init__(self) -> None:
        self._last_read: dict[TopicPartition, datetime] = {}

    def observe(self, polled: Mapping[TopicPartition, Sequence[TimedRecord]]) -> None:
        """Note the produce time of the last message read on each partition."""
        for partition, records in polled.items():
            if records:
                self._last_read[partition] = datetime.fromtimestamp(
                    records[-1].timestamp / 1000, UTC
                )

    def by_partition(
        self, consumer: PartitionOffsets, topics: Collection[str], now: datetime
    ) -> dict[int, datetime]:
        """Partition number -> watermark, for the partitions this worker owns on every topic."""
        marks: dict[int, datetime | None] = {}
        owned: dict[int, set[str]] = {}
        for partition in consumer.assignment():
            if partition.topic not in topics:
                continue
            highwater = consumer.highwater(partition)
            position = consumer.position(partition)
            caught_up = highwater is not None and position is not None and position >= highwater
            mark = now if caught_up else self._last_read.get(partition)
            previous = marks.get(partition.partition, now)
            marks[partition.partition] = (
                None if mark is None or previous is None else min(previous, mark)
            )
            owned.setdefault(partition.partition, set()).add(partition.topic)
        return {
            number: mark
            for number, mark in marks.items()
            if mark is not None and owned[number] == set(topics)
        }
