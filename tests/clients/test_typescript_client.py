"""The TypeScript IDE client (`clients/typescript`) against a real gateway: a completion, its
acceptance and survival windows sent through the client's queue, read back from Kafka."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import orjson
import pytest

from app.events import FEEDBACK_TOPIC
from tests.gateway.conftest import GatewayServer, KafkaTopics

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "typescript"
GATEWAY_TEST = CLIENT / "build" / "test" / "integration" / "gateway.test.js"


def built_client() -> Path:
    """The compiled gateway test, rebuilt from its sources when the client's tools are installed."""
    if (CLIENT / "node_modules" / ".bin" / "tsc").exists():
        subprocess.run(["npm", "run", "--silent", "build"], cwd=CLIENT, check=True, timeout=300)
    if not GATEWAY_TEST.exists():
        pytest.fail(f"{GATEWAY_TEST} is not built: run `make ts-client`")
    return GATEWAY_TEST


def test_acceptance_and_survival_windows_arrive_once(
    gateway_server: GatewayServer, ide_key: str, kafka: KafkaTopics, tmp_path: Path
) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH")
    gateway_test = built_client()
    since = kafka.end_offsets(FEEDBACK_TOPIC)
    result_file = tmp_path / "sent.json"

    run = subprocess.run(
        [node, "--test", str(gateway_test)],
        env={
            **os.environ,
            "RTRL_GATEWAY_URL": gateway_server.url,
            "RTRL_API_KEY": ide_key,
            "RTRL_RESULT_FILE": str(result_file),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert result_file.exists(), f"the client's gateway test did not run:\n{run.stdout}"
    sent = orjson.loads(result_file.read_bytes())
    request_id, session_id = sent["request_id"], sent["session_id"]

    events = [
        event
        for event in kafka.read(
            FEEDBACK_TOPIC,
            since,
            until=lambda read: sum(e["request_id"] == request_id for e in read) >= 6,
        )
        if event["request_id"] == request_id
    ]
    assert sorted(e["event_id"] for e in events) == sorted(e["event_id"] for e in sent["events"])
    assert KafkaTopics.duplicates(events) == {}
    assert {(e["session_id"], e["_key"]) for e in events} == {(session_id, session_id)}
    assert [e["kind"] for e in events].count("edit_accepted") == 1
    windows = sorted(
        (e["elapsed_s"], e["surviving_share"], e["censored"])
        for e in events
        if e["kind"] == "edit_survival"
    )
    # Measured at 30 s (untouched) and 2 min (one character of 17 changed: 12 of 14
    # four-grams kept); the document closed before 5 min, so 5, 10 and 15 min are censored.
    assert windows == [
        (30, 1.0, False),
        (120, pytest.approx(12 / 14), False),
        (300, None, True),
        (600, None, True),
        (900, None, True),
    ]
