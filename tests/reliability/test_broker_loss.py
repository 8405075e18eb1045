"""A broker that loses its log (the embedded one keeps it in memory only): the gateways send
the events they retained again, the workers read the new log from its start and deduplicate,
and the books balance."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.reliability.conftest import Loop, wait_until

pytestmark = pytest.mark.slow


def test_a_restarted_broker_gets_every_event_again_while_the_workers_are_down(loop: Loop) -> None:
    loop.workers[0].stop()
    report = loop.traffic(seed=21).result()
    assert report.requests_failed == 0 and report.feedback_batches_failed == 0
    wait_until(lambda: loop.ready()["spooled_events"]["disk"] == 0, 30, "Kafka to have it all")
    assert loop.ready()["spool_retained"]["bytes"] > 0

    loop.stack.kafka.stop()
    loop.stack.kafka.start()  # memory storage: the topics are re-created, empty
    loop.workers[0].start()
    books = loop.wait_for_books([report], timeout=180)
    assert books.balanced, books
    assert books.served == report.requests_ok


def test_a_broker_killed_mid_traffic_with_a_worker_behind_loses_nothing(loop: Loop) -> None:
    worker = loop.workers[0]
    traffic = loop.traffic(users=8, seed=22)
    time.sleep(3)
    worker_pid, broker_pid = worker.pid(), loop.stack.kafka.pid()
    assert worker_pid is not None and broker_pid is not None
    os.kill(worker_pid, signal.SIGSTOP)  # it falls behind what Kafka holds
    try:
        time.sleep(3)
        os.kill(broker_pid, signal.SIGKILL)
        time.sleep(2)
        loop.stack.kafka.start()
    finally:
        os.kill(worker_pid, signal.SIGCONT)
    report = traffic.result()
    assert report.requests_failed == 0 and report.feedback_batches_failed == 0, report.errors
    books = loop.wait_for_books([report], timeout=180)
    assert books.balanced, books
    assert books.served == report.requests_ok
