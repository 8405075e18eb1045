"""The write-ahead disk spool: the events a gateway answered for, until Kafka has them.

A directory of append-only JSON-lines segments with a cursor file that records how far
Kafka acknowledged; delivered segments are deleted. Appends go to the page cache (no fsync)
so the request path stays fast; the sink fsyncs each batch before sending it. One gateway
holds the directory at a time (a file lock).
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson

from app.gateway.metrics import EVENTS_SPOOLED

log = logging.getLogger(__name__)

SEGMENT_BYTES = 16 * 1024 * 1024
CURSOR_FILE = "cursor.json"
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


class SpoolLocked(RuntimeError):
    """Another process (or sink) already owns this spool directory."""


class DiskSpool:
    """A durable FIFO of envelopes: append-only segment files and a replay cursor."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
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
        self._segments = sorted(self._segment_numbers())
        self._cursor = self._load_cursor()
        for number in [n for n in self._segments if n < self._cursor.segment]:
            self._remove_segment(number)
        if self._segments and self._segments[0] > self._cursor.segment:
            self._cursor = Cursor(segment=self._segments[0])
        if self._segments:
            _truncate_partial_line(self._path(self._segments[-1]))
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
            if tail.tell() >= SEGMENT_BYTES:
                self._close_tail()
        for envelope in envelopes:
            EVENTS_SPOOLED.labels(envelope.topic).inc()

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
                    batch = self._read_segment(head, limit)
                    if batch or head == self._tail_number():
                        return batch
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

    def _open_tail(self) -> IO[bytes]:
        if self._tail is None:
            last = self._segments[-1] if self._segments else None
            if last is None or self._path(last).stat().st_size >= SEGMENT_BYTES:
                # Numbers only grow, so the cursor never points into a newer file by mistake.
                newest = max(-1 if last is None else last, self._cursor.segment - 1)
                self._segments.append(newest + 1)
            self._tail = open(self._path(self._segments[-1]), "ab")  # noqa: SIM115
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
                    self._cursor.delivered.add(start)
                    self.pending -= 1
                    continue
                batch.append(SpooledEnvelope(envelope, number, start, position))
        return batch

    def _next_segment(self) -> int:
        """Point the cursor past the head segment; returns the head, for `_forget`."""
        head = self._segments.pop(0)
        self._cursor = Cursor(segment=self._segments[0] if self._segments else head + 1)
        return head

    # -- the reader's, without the mutex: appends never wait on these fsyncs --------------

    def _forget(self, finished: Sequence[int]) -> None:
        """Save the cursor, then delete the segments it has moved past."""
        self._save_cursor()
        for number in finished:
            self._path(number).unlink(missing_ok=True)

    def _remove_segment(self, number: int) -> None:
        self._path(number).unlink(missing_ok=True)
        if number in self._segments:
            self._segments.remove(number)

    def _load_cursor(self) -> Cursor:
        try:
            raw = orjson.loads((self.directory / CURSOR_FILE).read_bytes())
            return Cursor(int(raw["segment"]), int(raw["offset"]), set(raw["delivered"]))
        except FileNotFoundError:
            return Cursor(segment=self._segments[0] if self._segments else 0)

    def _save_cursor(self) -> None:
        cursor = self._cursor
        staging = self.directory / f".{CURSOR_FILE}.tmp"
        with open(staging, "wb") as file:
            file.write(
                orjson.dumps(
                    {
                        "segment": cursor.segment,
                        "offset": cursor.offset,
                        "delivered": sorted(cursor.delivered),
                    }
                )
            )
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, self.directory / CURSOR_FILE)

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
