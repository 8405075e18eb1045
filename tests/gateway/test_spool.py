"""The disk spool: segments replayed in order, across restarts, torn lines, one owner;
retention and rewinds; one spool per gateway under a shared root."""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from app.gateway import spool as spool_module
from app.gateway.spool import DiskSpool, Envelope, Retention, SpoolLocked
from app.gateway.spool_dirs import adopt_free_spools, claim_spool, spool_directories


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


def deliver_all(spool: DiskSpool) -> list[int]:
    delivered: list[int] = []
    while batch := spool.read(7):
        delivered += numbers(batch)
        spool.acknowledge(batch, [True] * len(batch))
    return delivered


def age(path: Path, hours: float) -> None:
    then = time.time() - hours * 3600
    os.utime(path, (then, then))


def test_delivered_events_are_retained_and_a_rewind_sends_them_again_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 200)
    spool = DiskSpool(tmp_path, Retention(timedelta(hours=1), 1 << 20))
    for start in range(0, 40, 4):
        spool.append(envelopes(4, start))
    assert deliver_all(spool) == list(range(40))
    spool.save_topic_ids({"t": "log-1"})
    assert spool.pending == 0 and spool.retained_segments > 3
    spool.close()

    reopened = DiskSpool(tmp_path, Retention(timedelta(hours=1), 1 << 20))
    assert reopened.pending == 0 and reopened.topic_ids == {"t": "log-1"}
    assert reopened.rewind() == 40 and reopened.pending == 40
    reopened.append(envelopes(1, 40))
    assert deliver_all(reopened) == list(range(41))


def test_retention_keeps_the_window_within_its_byte_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 200)
    spool = DiskSpool(tmp_path)
    for start in range(0, 40, 4):
        spool.append(envelopes(4, start))
    spool.close()
    segments = sorted(tmp_path.glob("segment-*.jsonl"))
    for old in segments[:3]:
        age(old, hours=2)
    deliver_all(DiskSpool(tmp_path, Retention(timedelta(hours=1), 1 << 20)))

    window = DiskSpool(tmp_path, Retention(timedelta(hours=1), 1 << 20))
    window.prune()
    assert sorted(tmp_path.glob("segment-*.jsonl")) == segments[3:]
    kept = window.retained_segments
    window.close()

    capped = DiskSpool(tmp_path, Retention(timedelta(hours=1), 450))
    capped.prune()
    assert capped.retained_bytes <= 450 and 0 < capped.retained_segments < kept
    # The newest are kept: a rewind sends the last events again.
    capped.rewind()
    assert deliver_all(capped)[-1] == 39


def test_a_rewind_since_a_time_sends_the_segments_written_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spool_module, "SEGMENT_BYTES", 200)
    spool = DiskSpool(tmp_path)
    for start in range(0, 40, 4):
        spool.append(envelopes(4, start))
    deliver_all(spool)
    spool.close()
    segments = sorted(tmp_path.glob("segment-*.jsonl"))
    for hours, segment in enumerate(reversed(segments[:-2]), start=1):
        age(segment, hours=hours)

    reopened = DiskSpool(tmp_path, Retention(timedelta(hours=24), 1 << 20))
    resent = reopened.rewind(since=datetime.now(UTC) - timedelta(minutes=90))
    replayed = deliver_all(reopened)
    # The segment written an hour ago and the two written now, in order, ending at the last.
    assert len(replayed) == resent and replayed == list(range(40 - resent, 40))
    assert resent < 40


def test_a_gateway_claims_a_free_spool_and_adopts_the_others(tmp_path: Path) -> None:
    retention = Retention()
    first = claim_spool(tmp_path, retention)
    first.append(envelopes(3))
    second = claim_spool(tmp_path, retention)
    assert second.directory != first.directory
    first.close()

    # The first gateway stopped: a new one carries on with its spool.
    third = claim_spool(tmp_path, retention)
    assert third.directory == first.directory and third.pending == 3
    assert adopt_free_spools(tmp_path, retention, [third.directory, second.directory]) == []
    second.close()
    (adopted,) = adopt_free_spools(tmp_path, retention, [third.directory])
    assert adopted.directory == second.directory and adopted.empty
    adopted.remove()
    assert not second.directory.exists()
    assert spool_directories(tmp_path) == [third.directory]


def test_a_spool_written_straight_into_the_root_is_adopted(tmp_path: Path) -> None:
    legacy = DiskSpool(tmp_path)
    legacy.append(envelopes(2))
    legacy.close()
    home = claim_spool(tmp_path, Retention())
    assert home.directory.parent == tmp_path and home.pending == 0
    (adopted,) = adopt_free_spools(tmp_path, Retention(), [home.directory])
    assert adopted.directory == tmp_path and numbers(adopted.read(10)) == [0, 1]
