"""The write-ahead disk spool: the events a gateway answered for, until Kafka has them, and
for a retention window after, so they can be sent again should the broker lose them.

A directory of append-only JSON-lines segments with a cursor file that records how far
Kafka acknowledged. Delivered segments are kept while they are younger than the retention
window and within its byte cap, then deleted; `rewind` marks them undelivered again. Appends
go to the page cache (no fsync) so the request path stays fast; the sink fsyncs them every
200 ms, and each batch before sending it. One gateway holds the directory at a time (a file lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO

import orjson

from app.gateway.metrics import EVENTS_SPOOLED

log = logging.getLogger(__name__)

SEGMENT_BYTES = 16 * 1024 * 1024
SEGMENT_SECONDS = 300.0
"""A segment is also closed after this long, so that retention and a replay `since` a time
work in steps of minutes rather than of 16 MiB."""
CURSOR_FILE = "cursor.json"
TOPIC_IDS_FILE = "topic_ids.json"
LOCK_FILE = "spool.lock"


@dataclass(frozen=True, slots=True)
class Envelope:
    """One Kafka message: topic, key (the session id) and the encoded event."""

    topic: str
    key: str
    value: bytes

    def line(self) -> bytes:
        # The value as a string, so that a replay sends exactly the bytes that were queued.
        return orjson.dumps({"topic": self.topic, "key": self.key, "value": self.value.decode()})

    @classmethod
    def from_line(cls, line: bytes) -> Envelope:
        entry = orjson.loads(line)
        return cls(entry["topic"], entry["key"], entry["value"].encode())


@dataclass(frozen=True, slots=True)
class SpooledEnvelope:
    envelope: Envelope
    segment: int
    start: int
    end: int


@dataclass
class Cursor:
    """Replay progress: the head segment, the offset before which all is delivered, and
    the starts of later lines already delivered (a batch that partly failed)."""

    segment: int = 0
    offset: int = 0
    delivered: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Retention:
    """How long delivered segments are kept for a replay, and how many bytes of them at most."""

    window: timedelta = timedelta(0)
    max_bytes: int = 0

    def keeps(self, age_s: float, total_bytes: int) -> bool:
        return age_s <= self.window.total_seconds() and total_bytes <= self.max_bytes


@dataclass(frozen=True, slots=True)
class SegmentFile:
    size: int
    modified: float


class SpoolLocked(RuntimeError):
    """Another process (or sink) already owns this spool directory."""


class DiskSpool:
    """A durable FIFO of envelopes: append-only segment files and a replay cursor."""

    def __init__(self, directory: Path, retention: Retention | None = None) -> None:
        self.directory = directory
        self.retention = retention or Retention()
        directory.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(directory / LOCK_FILE, "a+b")  # noqa: SIM115
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise SpoolLocked(f"spool {directory} is in use by another gateway") from None
        self._mutex = threading.Lock()
        self._tail: IO[bytes] | None = None
        self._unsynced = False
        self._directory_unsynced = False
        self._tail_opened = 0.0
        numbers = sorted(self._segment_numbers())
        self._cursor = self._load_cursor(numbers)
        self._retained: dict[int, SegmentFile] = {}
        """Delivered segments kept for a replay, oldest first."""
        for number in numbers:
            if number < self._cursor.segment:
                self._retained[number] = self._stat(number)
        self._segments = [n for n in numbers if n >= self._cursor.segment]
        if self._segments:
            _truncate_partial_line(self._path(self._segments[-1]))
        for empty in [n for n in self._segments if not self._stat(n).size]:
            # Opened and never written to; a reader would never move past it.
            self._path(empty).unlink()
            self._segments.remove(empty)
        if self._segments and self._segments[0] > self._cursor.segment:
            self._cursor = Cursor(segment=self._segments[0])
        self._topic_ids = self._load_topic_ids()
        self.pending = self._count_pending()

    def close(self) -> None:
        with self._mutex:
            self._close_tail()
        if self._directory_unsynced:
            _fsync_directory(self.directory)
        self._lock_file.close()

    def append(self, envelopes: Sequence[Envelope]) -> None:
        """Append in order, to the page cache: safe from a crash of this process at once,
        and from a crash of the machine after the next `sync`."""
        if not envelopes:
            return
        data = b"".join(envelope.line() + b"\n" for envelope in envelopes)
        with self._mutex:
            tail = self._open_tail()
            tail.write(data)
            tail.flush()
            self._unsynced = True
            self.pending += len(envelopes)
            if (
                tail.tell() >= SEGMENT_BYTES
                or time.monotonic() - self._tail_opened >= SEGMENT_SECONDS
            ):
                self._close_tail()
        for envelope in envelopes:
            EVENTS_SPOOLED.labels(envelope.topic).inc()

    @property
    def synced(self) -> bool:
        """Whether every append so far is on disk (fsynced), not only in the page cache."""
        with self._mutex:
            return not self._unsynced and not self._directory_unsynced

    def sync(self) -> None:
        """Make earlier appends durable; appends go on meanwhile, as fsync runs unlocked."""
        with self._mutex:
            fd = os.dup(self._tail.fileno()) if self._tail is not None and self._unsynced else -1
            self._unsynced = False
            directory, self._directory_unsynced = self._directory_unsynced, False
        if fd >= 0:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        if directory:
            _fsync_directory(self.directory)

    def read(self, limit: int) -> list[SpooledEnvelope]:
        """Up to `limit` undelivered envelopes from the head segment, oldest first.

        `read` and `acknowledge` belong to one thread, the only one that moves the cursor.
        """
        finished: list[int] = []
        try:
            while True:
                with self._mutex:
                    if not self._segments:
                        return []
                    head = self._segments[0]
                    written_to = head == self._tail_number()
                # Read and parsed unlocked, so that appends (the request path) never wait on
                # it: lines are appended whole, and only this thread moves the cursor.
                batch = self._read_segment(head, limit)
                if batch or written_to:
                    return batch
                with self._mutex:
                    # A finished segment that is no longer written to: move past it.
                    finished.append(self._next_segment())
        finally:
            if finished:
                self._forget(finished)

    def acknowledge(self, batch: Sequence[SpooledEnvelope], delivered: Sequence[bool]) -> None:
        """Record which of a `read` batch Kafka acknowledged, durably, before the next read."""
        finished: list[int] = []
        with self._mutex:
            cursor = self._cursor
            in_prefix = True
            for item, ok in zip(batch, delivered, strict=True):
                if ok and in_prefix:
                    cursor.offset = item.end
                elif ok:
                    cursor.delivered.add(item.start)
                else:
                    in_prefix = False
            cursor.delivered = {start for start in cursor.delivered if start >= cursor.offset}
            self.pending -= sum(delivered)
            head = self._segments[0] if self._segments else None
            if (
                head is not None
                and head != self._tail_number()
                and cursor.offset >= self._path(head).stat().st_size
            ):
                finished.append(self._next_segment())
        self._forget(finished)

    def rewind(self, since: datetime | None = None) -> int:
        """Mark the retained events undelivered again, all of them or those of the segments
        written to at or after `since`, so they are sent again in order; returns how many.

        Like `read`, it belongs to the one thread that moves the cursor.
        """
        threshold = since.timestamp() if since is not None else float("-inf")
        with self._mutex:
            retained = list(self._retained)
            start = next(
                (i for i, n in enumerate(retained) if self._retained[n].modified >= threshold),
                len(retained),
            )
            again = retained[start:]
            head = self._segments[0] if self._segments else None
        if head is not None and not again and self._stat(head).modified < threshold:
            head = None
        if not again and (head is None or (not self._cursor.offset and not self._cursor.delivered)):
            return 0
        # Counted unlocked, so appends never wait on it: these bytes no longer change.
        count = sum(_count_lines(self._path(n)) for n in again)
        if head is not None:
            count += _count_lines(self._path(head), self._cursor.offset)
            count += len(self._cursor.delivered)
        with self._mutex:
            for number in again:
                del self._retained[number]
            self._segments[:0] = again
            self._cursor = Cursor(segment=self._segments[0])
            self.pending += count
        self._save_cursor()
        return count

    def prune(self) -> None:
        """Delete the delivered segments that are past the retention window or its byte cap."""
        now = time.time()
        with self._mutex:
            total = sum(segment.size for segment in self._retained.values())
            expired = []
            for number, segment in self._retained.items():
                if self.retention.keeps(now - segment.modified, total):
                    break
                expired.append(number)
                total -= segment.size
            for number in expired:
                del self._retained[number]
        for number in expired:
            self._path(number).unlink(missing_ok=True)

    @property
    def retained_bytes(self) -> int:
        """Delivered bytes still on disk: whole segments, and the head's delivered part."""
        with self._mutex:
            return self._cursor.offset + sum(s.size for s in self._retained.values())

    @property
    def retained_segments(self) -> int:
        with self._mutex:
            return len(self._retained) + (self._cursor.offset > 0)

    @property
    def retained_since(self) -> float | None:
        """When the oldest retained segment was last written to (a Unix time)."""
        with self._mutex:
            oldest = next(iter(self._retained.values()), None)
            if oldest is None and self._cursor.offset:
                oldest = self._stat(self._cursor.segment)
            return oldest.modified if oldest is not None else None

    @property
    def empty(self) -> bool:
        """Nothing to send and nothing retained."""
        with self._mutex:
            return not self.pending and not self._retained and not self._segments

    @property
    def topic_ids(self) -> dict[str, str]:
        """The Kafka topic id (the log) that each topic's delivered, retained events are in."""
        return dict(self._topic_ids)

    def save_topic_ids(self, topic_ids: Mapping[str, str]) -> None:
        """Record, durably, which log each topic's delivered events went to from now on."""
        self._topic_ids.update(topic_ids)
        _write_atomically(self.directory / TOPIC_IDS_FILE, orjson.dumps(self._topic_ids))

    def remove(self) -> None:
        """Delete the spool's files and directory, then release it; for an empty spool."""
        with self._mutex:
            self._close_tail()
            numbers = [*self._retained, *self._segments]
            self._retained.clear()
            self._segments.clear()
        for number in numbers:
            self._path(number).unlink(missing_ok=True)
        for name in (CURSOR_FILE, TOPIC_IDS_FILE, LOCK_FILE):
            (self.directory / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # a spool root still holds the gateways' directories
        self._lock_file.close()

    # -- internals; callers hold self._mutex --------------------------------------------

    def _path(self, number: int) -> Path:
        return self.directory / f"segment-{number:012d}.jsonl"

    def _segment_numbers(self) -> list[int]:
        return [
            int(path.stem.removeprefix("segment-"))
            for path in self.directory.glob("segment-*.jsonl")
        ]

    def _tail_number(self) -> int | None:
        return self._segments[-1] if self._tail is not None else None

    def _stat(self, number: int) -> SegmentFile:
        stat = self._path(number).stat()
        return SegmentFile(stat.st_size, stat.st_mtime)

    def _open_tail(self) -> IO[bytes]:
        if self._tail is None:
            # Always a new segment: numbers only grow, so the cursor never points into a
            # newer file by mistake, and a segment's time tells when its events were written.
            newest = max([*self._retained, *self._segments, self._cursor.segment - 1])
            self._segments.append(newest + 1)
            self._tail = open(self._path(self._segments[-1]), "ab")  # noqa: SIM115
            self._tail_opened = time.monotonic()
            # Made durable by the next sync, which publishing never waits for.
            self._directory_unsynced = True
        return self._tail

    def _close_tail(self) -> None:
        if self._tail is not None:
            self._sync_tail()
            self._tail.close()
            self._tail = None

    def _sync_tail(self) -> None:
        if self._tail is not None and self._unsynced:
            os.fsync(self._tail.fileno())
            self._unsynced = False

    def _next_segment(self) -> int:
        """Point the cursor past the head segment, which is now retained; returns the head."""
        head = self._segments.pop(0)
        self._retained[head] = self._stat(head)
        self._cursor = Cursor(segment=self._segments[0] if self._segments else head + 1)
        return head

    # -- the reader's, without the mutex: appends never wait on these reads and fsyncs -------

    def _read_segment(self, number: int, limit: int) -> list[SpooledEnvelope]:
        start_offset = self._cursor.offset if number == self._cursor.segment else 0
        batch: list[SpooledEnvelope] = []
        with open(self._path(number), "rb") as segment:
            segment.seek(start_offset)
            position = start_offset
            while len(batch) < limit:
                line = segment.readline()
                if not line.endswith(b"\n"):
                    break
                start, position = position, position + len(line)
                if start in self._cursor.delivered:
                    continue
                try:
                    envelope = Envelope.from_line(line)
                except (orjson.JSONDecodeError, KeyError, TypeError):
                    log.error("dropping an unreadable spool line in %s at %d", segment.name, start)
                    with self._mutex:
                        self._cursor.delivered.add(start)
                        self.pending -= 1
                    continue
                batch.append(SpooledEnvelope(envelope, number, start, position))
        return batch

    def _forget(self, finished: Sequence[int]) -> None:
        """Save the cursor, then delete what retention no longer keeps."""
        self._save_cursor()
        if finished:
            self.prune()

    def _load_cursor(self, numbers: Sequence[int]) -> Cursor:
        try:
            raw = orjson.loads((self.directory / CURSOR_FILE).read_bytes())
            return Cursor(int(raw["segment"]), int(raw["offset"]), set(raw["delivered"]))
        except FileNotFoundError:
            return Cursor(segment=numbers[0] if numbers else 0)

    def _save_cursor(self) -> None:
        cursor = self._cursor
        _write_atomically(
            self.directory / CURSOR_FILE,
            orjson.dumps(
                {
                    "segment": cursor.segment,
                    "offset": cursor.offset,
                    "delivered": sorted(cursor.delivered),
                }
            ),
        )

    def _load_topic_ids(self) -> dict[str, str]:
        try:
            return dict(orjson.loads((self.directory / TOPIC_IDS_FILE).read_bytes()))
        except FileNotFoundError:
            return {}

    def _count_pending(self) -> int:
        pending = 0
        for number in self._segments:
            start = self._cursor.offset if number == self._cursor.segment else 0
            with open(self._path(number), "rb") as segment:
                segment.seek(start)
                position = start
                for line in segment:
                    if position not in self._cursor.delivered:
                        pending += 1
                    position += len(line)
        return pending


def _count_lines(path: Path, end: int | None = None) -> int:
    with open(path, "rb") as file:
        return file.read(end).count(b"\n")


def _write_atomically(path: Path, data: bytes) -> None:
    staging = path.with_name(f".{path.name}.tmp")
    with open(staging, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    os.replace(staging, path)


def _truncate_partial_line(path: Path) -> None:
    # A crash mid-append can leave half a line; it was never acknowledged to anyone.
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as file:
            file.truncate(data.rfind(b"\n") + 1)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
