"""`rtrl spool replay`: a stopped gateway's retained events sent again by hand, and a clear
refusal for a spool that a running gateway holds."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

from app.gateway.sink import EventSink
from app.gateway.spool import DiskSpool, Envelope, Retention
from app.gateway.spool_dirs import claim_spool
from rtrl.embedded.kafka import EmbeddedKafka
from tests.gateway.conftest import read_topic

TOPIC = "test.replay"


def replay_command(kafka: EmbeddedKafka, data_dir: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {
        "RTRL_DATA_DIR": str(data_dir),
        "RTRL_KAFKA_BOOTSTRAP_SERVERS": kafka.url,
    }
    command = [sys.executable, "-m", "rtrl.cli", "spool", "replay", "--timeout", "60"]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def test_a_stopped_gateways_retained_events_are_sent_again_by_hand(
    own_kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    events = [Envelope(TOPIC, "s", b'{"n": %d}' % n) for n in range(50)]
    spool = claim_spool(tmp_path / "spool", Retention(timedelta(hours=6), 1 << 30))
    sink = EventSink(own_kafka.url, spool)
    sink.start()
    for envelope in events:
        sink.publish_encoded(envelope)
    deadline = time.monotonic() + 30
    while sink.depth["disk"] and time.monotonic() < deadline:
        time.sleep(0.1)
    sink.close()  # the gateway stopped, every event delivered
    own_kafka.stop()
    own_kafka.start()  # and the broker lost them

    running = DiskSpool(spool.directory)  # as a running gateway holds it
    refused = replay_command(own_kafka, tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"{spool.directory} is held by a running gateway" in refused.stderr
    running.close()

    replayed = replay_command(own_kafka, tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "sent 50 events from 1 spools" in replayed.stdout
    assert read_topic(own_kafka.url, TOPIC, expected=50) == [e.value for e in events]
