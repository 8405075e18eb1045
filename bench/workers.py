"""Worker throughput: Kafka → Postgres rewards, beside a raw consume + COPY of the same rows.

Starts its own embedded Postgres and Kafka on free ports, produces a realistic stream
(completions the size of real ones, then the IDE's feedback on each in time order:
acceptance, survival at 30 s … 15 min, follow-ups, session ends), and measures in one run:
  pipeline  one worker process's batches (decode, validate, store, distil rewards, commit
            offsets) from its first polled record to its last;
  raw       consuming the same topics and COPYing the same rows into look-alike tables,
            with no validation, no rewards and no offsets.
Beside the wall-clock rates it prints the CPU each side used per event (this process,
Postgres), which stays comparable on a machine that other work is sharing.

    python -m bench.workers [--completions 5000] [--max-records 2000] [--parts]

`--parts` also prints where the pipeline's CPU goes, per event: decoding, storing the rows,
loading what distillation reads, distilling, writing the rewards, and Postgres's share of each.

(run with `-m` from the repository root: run as a file, this module would shadow the `workers`
package)
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import random
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psutil
import psycopg
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from sqlalchemy import func, select

from app.config import Settings
from app.db import upgrade_schema
from app.events import (
    CompletionEvent,
    EditAccepted,
    EditRejected,
    EditSurvival,
    Event,
    FollowupMessage,
    SessionEnd,
    encode,
)
from app.kafka.admin import ensure_topics
from app.kafka.clients import COMPRESSION
from app.processes import free_port
from rtrl.embedded.stack import EmbeddedStack
from workers.config import WorkerConfig
from workers.consumer import consume_batch, make_consumer, make_producer, tune_gc
from workers.repository import array_literal, feedback_events, make_worker_engine, rewards

PARTITIONS = 4
REQUESTS_PER_SESSION = 5
SECONDS_BETWEEN_COMPLETIONS = 0.25
SURVIVAL_WINDOWS_S = (30, 120, 300, 600, 900)
FOLLOWUPS = (
    "still broken, same error",
    "thanks, that fixed it",
    "can you also add a test for the empty case?",
    "Traceback (most recent call last):\n  File \"app.py\", line 3\nNameError: name 'x'",
    "不对，还是报错",
)


def make_stream(count: int, seed: int = 0) -> list[Event]:
    """`count` completions and the feedback on them, in the order they would happen."""
    rng = random.Random(seed)
    start = datetime.now(UTC)
    stream: list[Event] = []
    for n in range(count):
        served = start + timedelta(seconds=n * SECONDS_BETWEEN_COMPLETIONS)

        def at(seconds: float, served: datetime = served) -> datetime:
            return served + timedelta(seconds=seconds)

        ids = {"session_id": f"bench-s{n // REQUESTS_PER_SESSION}", "request_id": f"bench-r{n}"}
        tokens = [rng.randrange(32_000) for _ in range(120)]
        stream.append(
            CompletionEvent(
                **ids,
                occurred_at=served,
                checkpoint="ckpt-1",
                experiment_id=1,
                arm="control",
                user_hash=f"user{n % 97}",
                edit_requested=True,
                proposed_edit=rng.random() < 0.9,
                prompt_messages=[{"role": "user", "content": "Write f(x) returning x + 3. " * 20}],
                prompt_token_ids=[rng.randrange(32_000) for _ in range(300)],
                completion_token_ids=tokens,
                behaviour_logprobs=[-rng.random() for _ in tokens],
                completion_text="def f(x):\n    return x + 3\n" * 15,
                completion_chars=420,
                finish_reason="stop",
                ttft_ms=80.0,
                latency_ms=rng.uniform(200, 3000),
                tool_calls=1,
                malformed_tool_calls=int(rng.random() < 0.05),
            )
        )
        if rng.random() < 0.7:
            stream.append(EditAccepted(**ids, occurred_at=at(5)))
            stream += [
                EditSurvival(
                    **ids, occurred_at=at(5 + s), elapsed_s=s, surviving_share=rng.random()
                )
                for s in SURVIVAL_WINDOWS_S
            ]
        else:
            stream.append(EditRejected(**ids, occurred_at=at(5)))
        if rng.random() < 0.5:
            stream.append(FollowupMessage(**ids, occurred_at=at(60), message=rng.choice(FOLLOWUPS)))
        if n % REQUESTS_PER_SESSION == REQUESTS_PER_SESSION - 1:
            stream.append(SessionEnd(**ids, occurred_at=at(1000)))
    return sorted(stream, key=lambda event: event.occurred_at)


def produce(servers: str, config: WorkerConfig, stream: list[Event]) -> None:
    """Send the events to their topics, keyed by session as the gateway does."""
    producer = KafkaProducer(
        bootstrap_servers=servers,
        acks="all",
        enable_idempotence=True,
        compression_type=COMPRESSION,
        linger_ms=20,
        batch_size=256 * 1024,
    )
    for event in stream:
        topic = (
            config.completions_topic
            if isinstance(event, CompletionEvent)
            else config.feedback_topic
        )
        producer.send(topic, key=event.session_id.encode(), value=encode(event))
    producer.flush()
    producer.close()


@dataclass
class Measurement:
    events: int
    wall_s: float
    worker_cpu_s: float
    postgres_cpu_s: float

    def line(self, name: str) -> str:
        per_event = 1e6 / self.events
        return (
            f"{name:<9} {self.events / self.wall_s:6.0f} events/s wall, "
            f"{self.events / self.worker_cpu_s:6.0f} per CPU-second of its process "
            f"(CPU per event: {self.worker_cpu_s * per_event:.0f} µs here, "
            f"{self.postgres_cpu_s * per_event:.0f} µs in Postgres; {self.wall_s:.2f} s)"
        )


class Clocks:
    """Wall clock, this process's CPU and Postgres's CPU between `start()` and `stop()`."""

    def __init__(self, stack: EmbeddedStack) -> None:
        self.postmaster = psutil.Process(stack.postgres.pid())
        self.wall_s = self.cpu_s = self.postgres_s = 0.0

    def postgres_cpu(self) -> dict[int, float]:
        cpu = {}
        for process in [self.postmaster, *self.postmaster.children(recursive=True)]:
            try:
                times = process.cpu_times()
                cpu[process.pid] = times.user + times.system
            except psutil.Error:
                pass
        return cpu

    def start(self) -> None:
        self.began = (time.perf_counter(), time.process_time(), self.postgres_cpu())

    def stop(self) -> None:
        """Adds the time since `start()`; call it while the connections are open, since a
        backend that has exited takes its CPU time along."""
        (wall, cpu, postgres), now = self.began, self.postgres_cpu()
        self.wall_s += time.perf_counter() - wall
        self.cpu_s += time.process_time() - cpu
        self.postgres_s += sum(used - postgres.get(pid, 0.0) for pid, used in now.items())

    def measurement(self, events: int) -> Measurement:
        """What was added up since the last measurement."""
        measurement = Measurement(events, self.wall_s, self.cpu_s, self.postgres_s)
        self.wall_s = self.cpu_s = self.postgres_s = 0.0
        return measurement


PARTS = (
    ("decode", "workers.consumer", "decode_batch"),
    ("  of which follow-up verdicts", "workers.store", "is_dissatisfied"),
    ("store samples", "workers.store", "insert_samples"),
    ("store feedback", "workers.store", "insert_feedback"),
    ("load touched samples", "workers.store", "load_touched_samples"),
    ("load their feedback", "workers.store", "feedback_by_sample"),
    ("distil rewards", "workers.store", "reward_row"),
    ("write rewards", "workers.store", "upsert_rewards"),
    ("whole transaction", "workers.consumer", "_store"),
)
"""The pipeline's parts that `--parts` times: (label, module, function); later parts run
inside "whole transaction", "follow-up verdicts" inside "decode"."""


class Parts:
    """CPU per part of the pipeline, here and in Postgres: wraps the worker's own functions."""

    def __init__(self, clocks: Clocks) -> None:
        self.postmaster = clocks.postmaster
        self.postgres: list[psutil.Process] = []
        self.cpu_s: dict[str, float] = dict.fromkeys([label for label, _, _ in PARTS], 0.0)
        self.postgres_s = dict(self.cpu_s)
        for label, module_name, name in PARTS:
            module = importlib.import_module(module_name)
            setattr(module, name, self.timed(label, getattr(module, name)))

    def timed(self, label: str, function: Any) -> Any:
        # Postgres's CPU is read around the calls that talk to it (a few per batch) only.
        talks_to_postgres = label.startswith(("store", "load", "write", "whole"))

        @functools.wraps(function)
        def timed_function(*args: Any, **kwargs: Any) -> Any:
            postgres = self.postgres_cpu() if talks_to_postgres else {}
            started = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu_s[label] += time.thread_time() - started
                if talks_to_postgres:
                    now = self.postgres_cpu()
                    self.postgres_s[label] += sum(
                        used - postgres.get(pid, 0.0) for pid, used in now.items()
                    )

        return timed_function

    def postgres_cpu(self) -> dict[int, float]:
        """As `Clocks.postgres_cpu`, over the processes found at the first call: finding them
        scans every process on the machine, too slow to do around each call."""
        if not self.postgres:
            self.postgres = [self.postmaster, *self.postmaster.children(recursive=True)]
        cpu = {}
        for process in self.postgres:
            try:
                times = process.cpu_times()
                cpu[process.pid] = times.user + times.system
            except psutil.Error:
                pass
        return cpu

    def print(self, pipeline: Measurement) -> None:
        per_event = 1e6 / pipeline.events
        print(f"{'part':<31} CPU µs per event: here  Postgres")
        for label, cpu_s in self.cpu_s.items():
            postgres = self.postgres_s[label] * per_event
            print(f"{label:<31} {cpu_s * per_event:22.1f}  {postgres:8.1f}")
        inside = [label for label, _, _ in PARTS[2:-1]]
        others = self.cpu_s["whole transaction"] - sum(self.cpu_s[label] for label in inside)
        postgres_others = self.postgres_s["whole transaction"] - sum(
            self.postgres_s[label] for label in inside
        )
        others_line = f"{others * per_event:22.1f}  {postgres_others * per_event:8.1f}"
        print(f"{'  of which the rest':<31} {others_line}")
        rest = pipeline.worker_cpu_s - self.cpu_s["decode"] - self.cpu_s["whole transaction"]
        postgres_rest = pipeline.postgres_cpu_s - self.postgres_s["whole transaction"]
        rest_line = f"{rest * per_event:22.1f}  {postgres_rest * per_event:8.1f}"
        print(f"{'Kafka, offsets, the rest':<31} {rest_line}")


def run_pipeline(
    settings: Settings, config: WorkerConfig, phases: list[list[Event]], clocks: Clocks
) -> None:
    """One worker consuming each phase of the stream once it is produced; the clocks run
    from the first poll of a phase to its last stored batch, as the raw side's do."""
    tune_gc()  # as run_worker does
    engine = make_worker_engine(settings.database_url)
    consumer = make_consumer(settings, config)
    dlq = make_producer(settings)
    consumer.subscribe([config.completions_topic, config.feedback_topic])
    while not consumer.assignment():  # join the group while the topics are still empty
        consumer.poll(timeout_ms=200)
    stop = threading.Event()
    with engine.connect():  # connect before the clocks start
        pass
    for phase in phases:
        produce(settings.kafka_bootstrap_servers, config, phase)
        consumed = 0
        clocks.start()
        while consumed < len(phase):
            consumed += consume_batch(consumer, dlq, engine, config, stop)
        clocks.stop()
    consumer.close(autocommit=False)
    dlq.close()


def run_raw(
    servers: str, database_url: str, config: WorkerConfig, total: int, clocks: Clocks
) -> None:
    """Consume the same topics and COPY the same rows, nothing else."""
    consumer = KafkaConsumer(bootstrap_servers=servers, enable_auto_commit=False)
    consumer.assign(
        [
            TopicPartition(topic, partition)
            for topic in (config.completions_topic, config.feedback_topic)
            for partition in range(PARTITIONS)
        ]
    )
    consumer.seek_to_beginning()
    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        for table in ("samples", "feedback_events"):
            conn.execute(f"CREATE TABLE raw_{table} (LIKE {table} INCLUDING ALL)")
        conn.commit()
        clocks.start()
        consumed = 0
        while consumed < total:
            polled = consumer.poll(timeout_ms=500, max_records=config.max_records)
            samples, feedback = [], []
            for record in (r for batch in polled.values() for r in batch):
                payload = orjson.loads(record.value)
                if record.topic == config.completions_topic:
                    samples.append(raw_sample(payload))
                else:
                    feedback.append([payload.get(c) for c in RAW_FEEDBACK_COLUMNS])
                consumed += 1
            copy_rows(conn, "raw_samples", RAW_SAMPLE_COLUMNS, samples)
            copy_rows(conn, "raw_feedback_events", RAW_FEEDBACK_COLUMNS, feedback)
            conn.commit()
        clocks.stop()
    consumer.close()


RAW_FEEDBACK_COLUMNS = ["event_id", "request_id", "session_id", "kind", "elapsed_s"]
RAW_FEEDBACK_COLUMNS += ["surviving_share", "message", "occurred_at"]
RAW_SAMPLE_COLUMNS = ["event_id", "request_id", "session_id", "user_hash", "checkpoint"]
RAW_SAMPLE_COLUMNS += ["experiment_id", "arm", "privacy", "edit_requested", "proposed_edit"]
RAW_SAMPLE_COLUMNS += ["prompt_messages", "prompt_token_ids", "completion_token_ids"]
RAW_SAMPLE_COLUMNS += ["behaviour_logprobs", "completion_text", "completion_chars"]
RAW_SAMPLE_COLUMNS += ["finish_reason", "status", "ttft_ms", "latency_ms", "tool_calls"]
RAW_SAMPLE_COLUMNS += ["malformed_tool_calls", "served_at", "trainable"]


def raw_sample(payload: dict[str, Any]) -> list[Any]:
    payload = payload | {
        "served_at": payload["occurred_at"],
        "trainable": not payload["privacy"],
        "prompt_messages": orjson.dumps(payload["prompt_messages"]).decode(),
    }
    for name in ("prompt_token_ids", "completion_token_ids", "behaviour_logprobs"):
        payload[name] = array_literal(payload[name])  # as the worker does: psycopg's is slow
    return [payload.get(c) for c in RAW_SAMPLE_COLUMNS]


def copy_rows(conn: psycopg.Connection, table: str, columns: list[str], rows: list) -> None:
    if rows:
        with conn.cursor().copy(f"COPY {table} ({', '.join(columns)}) FROM STDIN") as copy:
            for row in rows:
                copy.write_row(row)


def bench(stack: EmbeddedStack, count: int, max_records: int, parts: bool = False) -> None:
    settings = Settings(database_url=stack.postgres.url, kafka_bootstrap_servers=stack.kafka.url)
    config = WorkerConfig.from_settings(
        settings,
        completions_topic="bench.completions",
        feedback_topic="bench.feedback",
        dlq_topic="bench.dlq",
        group_id="bench-workers",
        max_records=max_records,
    )
    ensure_topics(
        stack.kafka.url,
        {config.completions_topic: PARTITIONS, config.feedback_topic: PARTITIONS, "bench.dlq": 1},
    )
    # Completions first, then their feedback in time order: a batch of feedback then spans
    # a minute or two of IDE time, so most feedback events refresh a reward, as in production.
    stream = make_stream(count)
    phases: list[list[Event]] = [
        [e for e in stream if isinstance(e, CompletionEvent)],
        [e for e in stream if not isinstance(e, CompletionEvent)],
    ]
    print(f"{count} completions and {len(phases[1])} feedback events, batches of {max_records}")
    clocks = Clocks(stack)
    timed_parts = Parts(clocks) if parts else None
    run_pipeline(settings, config, phases, clocks)
    pipeline = clocks.measurement(len(stream))
    engine = make_worker_engine(stack.postgres.url)
    with engine.connect() as conn:
        stored = conn.scalar(select(func.count()).select_from(rewards))
        finalized = conn.scalar(select(func.count()).where(rewards.c.finalized_at.is_not(None)))
        feedback = conn.scalar(select(func.count()).select_from(feedback_events))
    engine.dispose()
    if stored != count or feedback != len(stream) - count:
        raise SystemExit(f"pipeline lost events: {stored} rewards, {feedback} feedback rows")
    run_raw(stack.kafka.url, stack.postgres.url, config, len(stream), clocks)
    raw = clocks.measurement(len(stream))

    print(pipeline.line("pipeline") + f" → {stored} rewards, {finalized} final")
    print(raw.line("raw"))
    wall_ratio = raw.wall_s / pipeline.wall_s
    cpu_ratio = (raw.worker_cpu_s + raw.postgres_cpu_s) / (
        pipeline.worker_cpu_s + pipeline.postgres_cpu_s
    )
    print(f"ratio     {wall_ratio:.2f} of raw (wall clock), {cpu_ratio:.2f} (CPU)")
    load = psutil.getloadavg()[0]
    print(f"load average {load:.1f} on {psutil.cpu_count()} CPUs")
    if timed_parts is not None:
        timed_parts.print(pipeline)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--completions", type=int, default=5000)
    parser.add_argument("--max-records", type=int, default=2000)
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also print the pipeline's CPU per event by part (the timing costs a little)",
    )
    args = parser.parse_args()
    logging.getLogger("kafka").setLevel(logging.ERROR)

    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as data_dir:
        stack = EmbeddedStack.at(
            Path(data_dir),
            postgres_port=free_port(),
            kafka_port=free_port(),
            redis_port=free_port(),
        )
        stack.postgres.start()
        stack.kafka.start()
        try:
            upgrade_schema(stack.postgres.url)
            bench(stack, args.completions, args.max_records, args.parts)
        finally:
            stack.kafka.stop()
            stack.postgres.stop()


if __name__ == "__main__":
    main()
