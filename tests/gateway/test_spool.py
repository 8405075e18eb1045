"""The disk spool: segments replayed in order, across restarts, torn lines, one owner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.gateway import spool as spool_module
from app.gateway.spool import DiskSpool, Envelope, SpoolLocked


def envelopes(count: int, start: int = 0, topic: str = "t") -> list[Envelope]:
    return [Envelope(topic, f"s{n % 3}", b'{"n": %d}' % n) for n in range(start, start + count)]


def numbers(batch: list[Any]) -> list[int]:
    return [int(item.envelope.value.split(b":")[1].strip(b" }")) for item in batch]


def test_the_disk_spool_replays_in_order_and_survives_a_restart(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    spool.append(envelopes(10))
    first = spool.read(4)
    spool.acknowledge(first, [True] * 4)
    spool.close()

    reopened = DiskSpool(tmp_path)
    assert reopened.pending == 6
    assert numbers(reopened.read(100)) == [4, 5, 6, 7, 8, 9]


def test_a_partly_failed_replay_resends_only_the_failures(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    spool.append(envelopes(6))
    batch = spool.read(6)
    spool.acknowledge(batch, [True, False, True, False, True, True])
    assert spool.pending == 2
    assert numbers(spool.read(6)) == [1, 3]
    spool.close()

    reopened = DiskSpool(tmp_path)
    retry = reopened.read(6)
    assert numbers(retry) == [1, 3]
    reopened.acknowledge(retry, [True, True])
    assert reopened.pending == 0 and reopened.read(6) == []
    assert not list(tmp_path.glob("segment-*.jsonl")), "delivered segments are removed"


def test_segments_rotate_and_delivered_ones_are_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 200)
    spool = DiskSpool(tmp_path)
    for start in range(0, 40, 4):
        spool.append(envelopes(4, start))
    assert len(list(tmp_path.glob("segment-*.jsonl"))) > 3

    replayed: list[int] = []
    while batch := spool.read(7):
        replayed += numbers(batch)
        spool.acknowledge(batch, [True] * len(batch))
    spool.append(envelopes(1, 40))
    replayed += numbers(spool.read(7))

    assert replayed == list(range(41))
    assert len(list(tmp_path.glob("segment-*.jsonl"))) == 1


def test_a_torn_last_line_is_dropped_and_the_directory_is_locked(tmp_path: Path) -> None:
    spool = DiskSpool(tmp_path)
    spool.append(envelopes(3))
    with pytest.raises(SpoolLocked):
        DiskSpool(tmp_path)
    spool.close()
    segment = next(tmp_path.glob("segment-*.jsonl"))
    segment.write_bytes(segment.read_bytes() + b'{"topic": "t", "ke')

    reopened = DiskSpool(tmp_path)
    assert reopened.pending == 3 and numbers(reopened.read(10)) == [0, 1, 2]
