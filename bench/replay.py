"""Recovering from a broker that lost its log: how long the gateway takes to send its retained
window again, and a worker to read it back and find every row already stored.

Starts its own embedded Postgres and Kafka on free ports. A sink with a retention window (the
gateway's) sends a realistic stream (`bench.workers.make_stream`) to Kafka, and one worker
consumes it into rewards: that first pass is the baseline. Then the broker restarts (memory
storage: its log is gone, the topics come back empty under new ids) and it measures, from
the restart:
  replay   until the sink has seen the new topic ids and Kafka has every retained event;
  re-read  until the same worker, back in its forgotten group from the earliest offset, has
           read them all, with no row added (every event is a duplicate);
and from the spool's bytes per event, the disk and the re-read time of a whole window at a
given traffic.

    python -m bench.replay [--completions 5000] [--rate 8.4] [--window-hours 6]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psutil
from kafka import KafkaConsumer
from sqlalchemy import Engine, func, select

from app.config import Settings
from app.db import upgrade_schema
from app.events import COMPLETIONS_TOPIC, FEEDBACK_TOPIC, CompletionEvent
from app.gateway.sink import EventSink
from app.gateway.spool import DiskSpool, Retention
from app.processes import free_port
from bench.workers import make_stream
from rtrl.embedded.stack import EmbeddedStack
from workers.config import WorkerConfig
from workers.consumer import consume_batch, make_consumer, make_producer, tune_gc
from workers.repository import feedback_events, make_worker_engine, samples


def stored_rows(engine: Engine) -> tuple[int, int]:
    with engine.connect() as conn:
        return (
            conn.scalar(select(func.count()).select_from(samples)) or 0,
            conn.scalar(select(func.count()).select_from(feedback_events)) or 0,
        )


def caught_up(consumer: KafkaConsumer) -> bool:
    """Whether the consumer has read to the end of every partition it was given."""
    partitions = consumer.assignment()
    if not partitions:
        return False
    ends = consumer.end_offsets(list(partitions))
    return all(consumer.position(tp) >= end for tp, end in ends.items())


def consume_until(
    consumer: KafkaConsumer, done: threading.Event, step: Callable[[], int], timeout_s: float = 600
) -> int:
    """Consume batches until `done` is set and the consumer has caught up; returns messages."""
    read = 0
    deadline = time.monotonic() + timeout_s
    while not (done.is_set() and caught_up(consumer)):
        if time.monotonic() > deadline:
            raise SystemExit("the worker did not catch up in time")
        read += step()
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--completions", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=8.4, help="Completions per second.")
    parser.add_argument("--window-hours", type=float, default=6.0)
    args = parser.parse_args()
    logging.getLogger("kafka").setLevel(logging.CRITICAL)

    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as data_dir:
        stack = EmbeddedStack.at(
            Path(data_dir), postgres_port=free_port(), kafka_port=free_port(), redis_port=0
        )
        stack.postgres.start()
        stack.kafka.start()
        try:
            upgrade_schema(stack.postgres.url)
            bench(stack, Path(data_dir), args.completions, args.rate, args.window_hours)
        finally:
            stack.kafka.stop()
            stack.postgres.stop()


def bench(
    stack: EmbeddedStack, data_dir: Path, count: int, rate: float, window_hours: float
) -> None:
    settings = Settings(database_url=stack.postgres.url, kafka_bootstrap_servers=stack.kafka.url)
    config = WorkerConfig.from_settings(
        settings, group_id="bench-replay", sweep_interval_s=None, monitor_interval_s=None
    )
    stream = make_stream(count)
    total = len(stream)
    print(f"{count} completions and {total - count} feedback events")

    spool = DiskSpool(data_dir / "spool", Retention(timedelta(hours=24), 1 << 40))
    sink = EventSink(stack.kafka.url, spool)
    sink.start()
    tune_gc()
    engine = make_worker_engine(settings.database_url)
    consumer = make_consumer(settings, config)
    dlq = make_producer(settings)
    consumer.subscribe([config.completions_topic, config.feedback_topic])
    stop = threading.Event()

    def step() -> int:
        return consume_batch(consumer, dlq, engine, config, stop)

    # Baseline: the gateway's first delivery, and the worker storing it all.
    delivered = threading.Event()
    started = time.perf_counter()
    for event in stream:
        topic = COMPLETIONS_TOPIC if isinstance(event, CompletionEvent) else FEEDBACK_TOPIC
        sink.publish(topic, event.session_id, event)

    def wait_for_delivery() -> None:
        if sink.drain(600):
            delivered.set()

    threading.Thread(target=wait_for_delivery, daemon=True).start()
    consume_until(consumer, delivered, step)
    first_s = time.perf_counter() - started
    rows = stored_rows(engine)
    if rows != (count, total - count):
        raise SystemExit(f"first pass stored {rows}, expected {(count, total - count)}")
    retained = sink.retained["bytes"]

    # The broker loses its log.
    stack.kafka.stop()
    stack.kafka.start()
    restarted = time.perf_counter()
    resent = threading.Event()
    resent_s = 0.0

    def wait_for_replay() -> None:
        nonlocal resent_s
        while not spool.pending:
            time.sleep(0.01)
        sink.drain(600)
        resent_s = time.perf_counter() - restarted
        resent.set()

    threading.Thread(target=wait_for_replay, daemon=True).start()
    reread = consume_until(consumer, resent, step)
    reread_s = time.perf_counter() - restarted
    added = tuple(after - before for after, before in zip(stored_rows(engine), rows, strict=True))
    sink.close()
    consumer.close(autocommit=False)
    dlq.close()
    engine.dispose()

    per_event = retained / total
    print(
        f"first pass  {total / first_s:6.0f} events/s: gateway to Kafka, worker storing "
        f"every row ({first_s:.1f} s)"
    )
    print(f"spool       {retained / 2**20:.1f} MiB retained, {per_event:.0f} bytes per event")
    print(
        f"replay      {total / resent_s:6.0f} events/s: Kafka had all {total} retained events "
        f"{resent_s:.1f} s after the restart (topic ids checked every 2 s)"
    )
    print(
        f"re-read     {total / reread_s:6.0f} events/s: the worker read {reread} messages and "
        f"was caught up {reread_s:.1f} s after the restart; rows added {added}"
    )
    events_per_completion = total / count
    window_events = rate * events_per_completion * window_hours * 3600
    print(
        f"a {window_hours:g} h window at {rate:g} completions/s ({window_events:,.0f} events): "
        f"{window_events * per_event / 2**30:.2f} GiB of spool, re-read in "
        f"~{window_events / (total / reread_s) / 60:.0f} min"
    )
    print(f"load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
