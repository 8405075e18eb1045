"""Replacing a gateway: SIGTERM makes it unready, refuses new requests and sends its spool
before it exits; a gateway beside it on the same volume adopts whatever a stopped one left."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from app.gateway.spool import DiskSpool
from app.gateway.spool_dirs import spool_directories
from tests.reliability.conftest import Loop, wait_until

pytestmark = pytest.mark.slow


def test_sigterm_turns_a_gateway_unready_refuses_requests_and_drains_its_spool(
    loop: Loop,
) -> None:
    loop.stack.kafka.stop()
    report = loop.traffic(seed=23).result()
    assert report.requests_failed == 0 and loop.ready()["spooled_events"]["disk"] > 0
    pid = loop.gateway.pid()
    assert pid is not None

    os.kill(pid, signal.SIGTERM)
    wait_until(lambda: loop.ready()["status"] == "shutting_down", 10, "readiness to fail")
    refused = httpx.post(
        f"{loop.url}/v1/chat/completions",
        json={"model": "rtrl", "messages": [{"role": "user", "content": "hi"}]},
        headers={"Authorization": f"Bearer {loop.ide_key}", "X-Session-Id": "s-late"},
        timeout=10,
    )
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["retry-after"]

    loop.stack.kafka.start()  # the broker returns within the drain window (20 s)
    stopped = time.monotonic()
    wait_until(lambda: loop.gateway.pid() is None, 30, "the gateway to exit")
    assert time.monotonic() - stopped < 25
    # Not restarted: it sent everything before it exited.
    for directory in spool_directories(loop.settings.spool_dir):
        assert DiskSpool(directory).pending == 0
    books = loop.wait_for_books([report], timeout=180)
    assert books.balanced, books


@pytest.mark.scenario
def test_a_gateway_adopts_and_sends_the_spool_a_stopped_gateway_left_beside_it(
    loop: Loop,
) -> None:
    # Both keep nothing once delivered, so an adopted spool is removed as soon as it is sent.
    loop.gateway.stop()
    loop.gateway.environment |= {"RTRL_SHUTDOWN_DRAIN": "2", "RTRL_SPOOL_RETENTION": "0"}
    loop.gateway.start()
    loop.stack.kafka.stop()
    first = loop.traffic(seed=24).result()
    spooled = loop.ready()["spooled_events"]["disk"]
    assert first.requests_failed == 0 and spooled > 0

    replacement = loop.another_gateway("gateway-2", RTRL_SPOOL_RETENTION="0")
    replacement.start()
    loop.gateway.stop()  # SIGTERM; Kafka is down, so its events stay in its spool
    assert len(spool_directories(loop.settings.spool_dir)) == 2
    wait_until(
        lambda: loop.ready(replacement)["spooled_events"]["disk"] >= spooled,
        30,
        "the replacement to adopt the spool left beside it",
    )
    second = loop.traffic(seed=25, gateway=replacement).result()

    loop.stack.kafka.start()
    try:
        books = loop.wait_for_books([first, second], timeout=180)
        assert books.balanced, books
        wait_until(
            lambda: len(spool_directories(loop.settings.spool_dir)) == 1,
            30,
            "the adopted spool to be removed",
        )
    finally:
        replacement.stop()
