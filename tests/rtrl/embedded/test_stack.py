"""Each embedded service answers a real round trip; `rtrl services` manages their lives."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import redis
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from sqlalchemy import func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.kafka.admin import ensure_topics
from app.models import Checkpoint, CheckpointStatus
from app.processes import ServiceError, free_port
from rtrl.embedded.redis import EmbeddedRedis
from rtrl.embedded.stack import EmbeddedStack


def test_postgres_holds_the_migrated_schema(db_session: Session) -> None:
    # Earlier tests may have left checkpoints: this one's rows are its own, rolled back after.
    def count() -> int:
        return db_session.scalar(select(func.count()).select_from(Checkpoint)) or 0

    before = count()
    first = Checkpoint(
        name=f"schema-{uuid.uuid4().hex[:8]}", status=CheckpointStatus.candidate, base_model="m"
    )
    db_session.add(first)
    db_session.flush()
    assert count() == before + 1

    # The database, not the code, guarantees a single production checkpoint.
    db_session.execute(
        update(Checkpoint)
        .where(Checkpoint.status == CheckpointStatus.production)
        .values(status=CheckpointStatus.retired)
    )
    first.status = CheckpointStatus.production
    db_session.flush()
    db_session.add(
        Checkpoint(
            name=f"schema-{uuid.uuid4().hex[:8]}",
            status=CheckpointStatus.production,
            base_model="m",
        )
    )
    with pytest.raises(IntegrityError):
        db_session.flush()


def test_kafka_group_consumes_and_commits_manually(stack: EmbeddedStack) -> None:
    topic = f"test.roundtrip.{uuid.uuid4().hex[:8]}"
    ensure_topics(stack.kafka.url, {topic: 2})
    producer = KafkaProducer(bootstrap_servers=stack.kafka.url, acks="all", enable_idempotence=True)
    for i in range(20):
        producer.send(topic, key=f"session-{i % 3}".encode(), value=f"event-{i}".encode())
    producer.flush()
    producer.close()

    def consumer() -> KafkaConsumer:
        return KafkaConsumer(
            topic,
            bootstrap_servers=stack.kafka.url,
            group_id="test-roundtrip",
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            session_timeout_ms=6000,
            heartbeat_interval_ms=1000,
            consumer_timeout_ms=8000,
        )

    first = consumer()
    received = [record.value.decode() for record in first]
    first.commit()
    committed = {
        partition: first.committed(TopicPartition(topic, partition))
        for partition in first.partitions_for_topic(topic) or set()
    }
    first.close()
    assert sorted(received) == sorted(f"event-{i}" for i in range(20))
    assert sum(offset or 0 for offset in committed.values()) == 20

    # A new member of the same group resumes after the committed offsets: nothing again.
    second = consumer()
    assert [record.value for record in second] == []
    second.close()


def test_redis_set_get(stack: EmbeddedStack) -> None:
    client = redis.Redis.from_url(stack.redis.url)
    client.set("rtrl:test", "value", ex=60)
    assert client.get("rtrl:test") == b"value"


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(ServiceError, match=f"port {port}.*already in use"):
            EmbeddedRedis(tmp_path / "redis", port).start()


def alive(pid: int) -> bool:
    """Running, as opposed to gone or a zombie waiting for init to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rtrl.cli", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_services_up_twice_status_and_down(tmp_path: Path) -> None:
    env = {
        "RTRL_DATA_DIR": str(tmp_path / "var"),
        "RTRL_EMBEDDED_POSTGRES_PORT": str(free_port()),
        "RTRL_EMBEDDED_KAFKA_PORT": str(free_port()),
        "RTRL_EMBEDDED_REDIS_PORT": str(free_port()),
    }
    for name in ("RTRL_DATABASE_URL", "RTRL_KAFKA_BOOTSTRAP_SERVERS", "RTRL_REDIS_URL"):
        env[name] = ""
    first = run_cli("services", "up", env=env)
    assert first.returncode == 0, first.stderr
    assert f"export RTRL_REDIS_URL='redis://127.0.0.1:{env['RTRL_EMBEDDED_REDIS_PORT']}/0'" in (
        first.stdout
    )
    second = run_cli("services", "up", env=env)
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout  # same pids: nothing was started twice

    status = run_cli("services", "status", env=env)
    assert status.returncode == 0
    running = [line for line in status.stdout.splitlines() if " running " in line]
    assert len(running) == 3
    pids = [int(line.split()[2]) for line in running]

    down = run_cli("services", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert not [pid for pid in pids if alive(pid)]
    leftovers = [
        process.pid
        for process in psutil.process_iter(["cmdline"])
        if str(tmp_path) in " ".join(process.info["cmdline"] or []) and alive(process.pid)
    ]
    assert leftovers == []

    stopped = run_cli("services", "status", env=env)
    assert stopped.returncode == 3
    assert stopped.stdout.count(" stopped ") == 3
