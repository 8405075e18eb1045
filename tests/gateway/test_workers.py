"""`rtrl gateway --workers N`: processes sharing one port, each with a spool of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson
import pytest
from sqlalchemy import Engine

from app.config import settings_environment
from app.events import COMPLETIONS_TOPIC
from app.gateway.spool import Envelope
from app.gateway.spool_dirs import spool_directories
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import RtrlProcess
from tests.conftest import external_settings


def served_request_ids(spool: Path) -> set[str]:
    """The request ids of the completions written to one spool directory."""
    ids = set()
    for segment in sorted(spool.glob("segment-*.jsonl")):
        for line in segment.read_bytes().splitlines():
            envelope = Envelope.from_line(line)
            if envelope.topic == COMPLETIONS_TOPIC:
                ids.add(orjson.loads(envelope.value)["request_id"])
    return ids


def test_two_workers_both_serve_and_each_writes_its_own_spool(
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    registry: Engine,
    make_key: Callable[..., str],
    tmp_path: Path,
) -> None:
    settings = external_settings(stack, vllm_server, tiny_model_dir, tmp_path / "data")
    url = f"http://127.0.0.1:{settings.gateway_port}"
    gateway = RtrlProcess(
        "gateway",
        ["gateway", "--workers", "2"],
        tmp_path / "run",
        tmp_path / "logs",
        settings_environment(settings),
        ready_url=f"{url}/readyz",
    )
    headers = {"Authorization": f"Bearer {make_key()}", "X-Session-Id": "s-workers"}
    body = {"model": "rtrl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    gateway.start(timeout=120)
    try:
        sent: set[str] = set()
        by_spool: dict[Path, set[str]] = {}
        # Each request on a new connection, which whichever worker accepts first serves.
        while len(sent) < 100 and not (len(by_spool) == 2 and all(by_spool.values())):
            request_id = f"w-{len(sent)}"
            answer = httpx.post(
                f"{url}/v1/chat/completions",
                json=body,
                headers=headers | {"X-Request-Id": request_id},
                timeout=60,
            )
            assert answer.status_code == 200, answer.text
            sent.add(request_id)
            by_spool = {d: served_request_ids(d) for d in spool_directories(settings.spool_dir)}
        readiness = [httpx.get(f"{url}/readyz").json() for _ in range(20)]
    finally:
        gateway.stop()

    assert len(by_spool) == 2, by_spool.keys()
    first, second = by_spool.values()
    assert first and second, "one worker served every request"
    assert not first & second
    assert first | second == sent
    assert {ready["spool"] for ready in readiness} <= {str(d) for d in by_spool}
    for pid in {ready["pid"] for ready in readiness}:  # the workers stopped with it
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
