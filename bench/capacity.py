"""Capacity model: what one completion costs, measured here, scaled to 1 M - 400 M a day.

Starts its own embedded Postgres and Kafka on free ports and measures, in one run:
  storage   the bytes each completion leaves in Postgres (every table, with its indexes and
            TOAST), after the worker's own path (Kafka → consume_batch → store_events) stored
            N completions of realistic size (prompt and completion token ids, logprobs, text)
            and the IDE's feedback on each: per sample, per feedback event, per reward;
  workers   the CPU one worker process and Postgres spend per completion and per feedback
            event carried Kafka → Postgres (CPU, not wall time: it stays comparable on a
            machine other work is sharing), beside the wall-clock rate;
  events    the bytes of each event on the wire (JSON, before the producer's lz4).
Then it prints the hardware for 1 M, 100 M and 400 M requests a day: Kafka partitions,
worker processes, gateway processes, vLLM replicas, Postgres storage per day and over the
retention window, with every assumption it used printed beside it.

    python -m bench.capacity [--completions 1000] [--prompt-tokens 2000]
        [--completion-tokens 300] [--replica-tokens-per-s 2500] [--peak-to-mean 3]

(run with `-m` from the repository root: run as a file, bench/workers.py would shadow the
`workers` package)
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import text

from app.config import Settings
from app.db import upgrade_schema
from app.events import CompletionEvent, Event, encode
from app.kafka.admin import ensure_topics
from app.processes import free_port
from bench.workers import Clocks, Measurement, make_stream, run_pipeline
from rtrl.embedded.stack import EmbeddedStack
from workers.config import WorkerConfig
from workers.repository import make_worker_engine

VOLUMES = (1_000_000, 100_000_000, 400_000_000)
PARTITIONS = 4
VOCABULARY = 151_000  # a Qwen-sized vocabulary: token ids as large as real ones
GATEWAY_CPU_MS = 3.5
GATEWAY_CPU_MS_PER_TOKEN = 0.1
"""bench.gateway on this machine (2026-12-06): 2.9-4.1 ms of gateway CPU a non-streaming
request over its four workloads; a streamed 100-token answer cost 5.8, 12.7 and 34.8 ms in
20, 100 and 300 chunks (`--stream-chunks`), 0.09-0.11 ms a chunk. vLLM sends a chunk a token
unless its --stream-interval is raised (RTRL_VLLM_STREAM_INTERVAL)."""
CODE_WORDS = ("def", "return", "self", "if", "else", "for", "in", "import", "None", "=", "(", ")")

# Every table's bytes, partitions counted under the table they belong to.
_TABLE_BYTES = text(
    "SELECT coalesce(pg_partition_root(c.oid), c.oid)::regclass::text AS name, "
    "sum(pg_total_relation_size(c.oid))::bigint AS bytes "
    "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
    "WHERE n.nspname = 'public' AND c.relkind IN ('r', 'm') GROUP BY 1"
)


@dataclass(frozen=True)
class Measured:
    """What one run on this machine found."""

    completions: int
    feedback: int
    table_bytes: dict[str, int]
    """Bytes each table grew by while the stream was stored."""
    worker_cpu_s: tuple[float, float]
    """A worker's CPU seconds per completion, per feedback event."""
    postgres_cpu_s: tuple[float, float]
    """Postgres's CPU seconds per completion, per feedback event (the worker's writes)."""
    worker_events_per_s: float
    """Events per second of wall clock, both phases together."""
    completion_event_bytes: float
    feedback_event_bytes: float

    @property
    def feedback_per_completion(self) -> float:
        return self.feedback / self.completions

    @property
    def bytes_per_completion(self) -> float:
        """Everything a completion leaves in Postgres: its sample, reward, feedback and the rest."""
        return sum(self.table_bytes.values()) / self.completions

    def cpu_per_completion(self, cpu: tuple[float, float]) -> float:
        """CPU seconds per completion and the feedback that follows it."""
        return cpu[0] + self.feedback_per_completion * cpu[1]

    @property
    def event_bytes_per_completion(self) -> float:
        return self.completion_event_bytes + self.feedback_per_completion * (
            self.feedback_event_bytes
        )


@dataclass(frozen=True)
class Assumptions:
    """The inputs the model scales by; each is a flag."""

    peak_to_mean: float
    retention_days: int
    kafka_retention_days: int
    replica_tokens_per_s: float
    """Generated tokens per second one vLLM replica sustains at the latency target."""
    gateway_cpu_ms: float
    """CPU a gateway process spends on one completion besides relaying its tokens (bench.gateway's
    CPU per request, non-streaming)."""
    gateway_cpu_ms_per_token: float
    """CPU per streamed token: vLLM sends each generated token as an SSE chunk, which the
    gateway reads, records and relays (bench.gateway with --stream-chunks 100 against 20)."""
    partition_mb_per_s: float
    """Write throughput planned per Kafka partition."""
    utilisation: float
    """The share of each component's measured capacity used at peak."""
    prompt_tokens: int
    completion_tokens: int


def realistic_stream(count: int, prompt_tokens: int, completion_tokens: int) -> list[Event]:
    """bench.workers' stream of completions and feedback, with completions of the given size."""
    rng = random.Random(7)

    def code(tokens: int) -> str:
        # About four characters a token, words repeated as in code, names not: compresses
        # roughly as source code does.
        words = [
            rng.choice(CODE_WORDS) if rng.random() < 0.6 else f"name_{rng.randrange(5000)}"
            for _ in range(tokens * 2 // 3)
        ]
        return " ".join(words)

    stream = make_stream(count)
    for index, event in enumerate(stream):
        if isinstance(event, CompletionEvent):
            completion = code(completion_tokens)
            stream[index] = event.model_copy(
                update={
                    "prompt_messages": [{"role": "user", "content": code(prompt_tokens)}],
                    "prompt_token_ids": [rng.randrange(VOCABULARY) for _ in range(prompt_tokens)],
                    "completion_token_ids": [
                        rng.randrange(VOCABULARY) for _ in range(completion_tokens)
                    ],
                    "behaviour_logprobs": [-rng.expovariate(2.0) for _ in range(completion_tokens)],
                    "completion_text": completion,
                    "completion_chars": len(completion),
                }
            )
    return stream


def table_bytes(database_url: str) -> dict[str, int]:
    engine = make_worker_engine(database_url)
    try:
        with engine.connect() as conn:
            return {row.name: int(row.bytes) for row in conn.execute(_TABLE_BYTES)}
    finally:
        engine.dispose()


def measure(
    stack: EmbeddedStack, count: int, prompt_tokens: int, completion_tokens: int
) -> Measured:
    """Store `count` realistic completions and their feedback through the worker; measure."""
    settings = Settings(database_url=stack.postgres.url, kafka_bootstrap_servers=stack.kafka.url)
    config = WorkerConfig.from_settings(
        settings,
        completions_topic="capacity.completions",
        feedback_topic="capacity.feedback",
        dlq_topic="capacity.dlq",
        group_id="capacity-workers",
        max_records=500,
    )
    ensure_topics(
        stack.kafka.url,
        {
            config.completions_topic: PARTITIONS,
            config.feedback_topic: PARTITIONS,
            "capacity.dlq": 1,
        },
    )
    stream = realistic_stream(count, prompt_tokens, completion_tokens)
    completions = [e for e in stream if isinstance(e, CompletionEvent)]
    feedback = [e for e in stream if not isinstance(e, CompletionEvent)]
    print(
        f"storing {len(completions)} completions ({prompt_tokens} prompt + {completion_tokens} "
        f"completion tokens) and {len(feedback)} feedback events through one worker ..."
    )
    before = table_bytes(stack.postgres.url)
    clocks = PhaseClocks(stack, [len(completions), len(feedback)])
    run_pipeline(settings, config, [completions, feedback], clocks)
    first, then = clocks.phases
    after = table_bytes(stack.postgres.url)
    grown = {name: after[name] - before.get(name, 0) for name in after}
    return Measured(
        completions=len(completions),
        feedback=len(feedback),
        table_bytes={name: grew for name, grew in grown.items() if grew > 0},
        worker_cpu_s=(first.worker_cpu_s / first.events, then.worker_cpu_s / then.events),
        postgres_cpu_s=(first.postgres_cpu_s / first.events, then.postgres_cpu_s / then.events),
        worker_events_per_s=len(stream) / (first.wall_s + then.wall_s),
        completion_event_bytes=sum(len(encode(e)) for e in completions) / len(completions),
        feedback_event_bytes=sum(len(encode(e)) for e in feedback) / len(feedback),
    )


class PhaseClocks(Clocks):
    """bench.workers' clocks, read once per phase of the stream (completions, then feedback)."""

    def __init__(self, stack: EmbeddedStack, sizes: list[int]) -> None:
        super().__init__(stack)
        self.sizes = sizes
        self.phases: list[Measurement] = []

    def stop(self) -> None:
        super().stop()
        self.phases.append(self.measurement(self.sizes[len(self.phases)]))


@dataclass(frozen=True)
class Plan:
    """The hardware for one volume of requests a day."""

    requests_per_day: int
    peak_completions_per_s: float
    peak_events_per_s: float
    worker_processes: int
    postgres_write_cores: float
    kafka_partitions: int
    gateway_processes: int
    vllm_replicas: int
    postgres_bytes_per_day: float
    postgres_bytes_retained: float
    postgres_write_bytes_per_s: float
    kafka_bytes_retained: float


def gateway_cpu_s(assume: Assumptions) -> float:
    """CPU seconds one gateway process spends on a completion streamed token by token."""
    tokens_ms = assume.completion_tokens * assume.gateway_cpu_ms_per_token
    return (assume.gateway_cpu_ms + tokens_ms) / 1000


def plan(requests_per_day: int, measured: Measured, assume: Assumptions) -> Plan:
    """Size every component for `requests_per_day` at the assumed peak and utilisation."""
    peak = requests_per_day / 86_400 * assume.peak_to_mean
    events = peak * (1 + measured.feedback_per_completion)
    # A worker is one Python process: one core at most.
    worker_cores = peak * measured.cpu_per_completion(measured.worker_cpu_s)
    workers = math.ceil(worker_cores / assume.utilisation)
    wire = peak * measured.event_bytes_per_completion
    by_bytes = math.ceil(wire / (assume.partition_mb_per_s * 1e6 * assume.utilisation))
    # Room to double the workers without adding partitions, which would move sessions' keys.
    partitions = 2 ** math.ceil(math.log2(2 * max(workers, by_bytes)))
    per_day = requests_per_day * measured.bytes_per_completion
    return Plan(
        requests_per_day=requests_per_day,
        peak_completions_per_s=peak,
        peak_events_per_s=events,
        worker_processes=workers,
        postgres_write_cores=peak * measured.cpu_per_completion(measured.postgres_cpu_s),
        kafka_partitions=partitions,
        # A gateway process is one event loop: one core at most. Every completion is counted
        # as streamed, as IDE clients ask for them.
        gateway_processes=math.ceil(peak * gateway_cpu_s(assume) / assume.utilisation),
        vllm_replicas=math.ceil(
            peak * assume.completion_tokens / (assume.replica_tokens_per_s * assume.utilisation)
        ),
        postgres_bytes_per_day=per_day,
        postgres_bytes_retained=per_day * assume.retention_days,
        postgres_write_bytes_per_s=peak * measured.bytes_per_completion,
        kafka_bytes_retained=requests_per_day
        * measured.event_bytes_per_completion
        * assume.kafka_retention_days,
    )


def size(value: float) -> str:
    """Bytes in binary units, three significant figures."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024 or unit == "PiB":
            return f"{value:.3g} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(value: float) -> str:
    return f"{value:,.0f}"


def report(measured: Measured, assume: Assumptions) -> None:
    """Print what was measured, the assumptions, and the plan for each volume."""
    per, n = measured.table_bytes, measured.completions
    print("\nmeasured on this machine")
    print(f"  Postgres per completion, all tables   {size(measured.bytes_per_completion)}")
    print(f"    per sample (samples)                {size(per.get('samples', 0) / n)}")
    feedback_row = per.get("feedback_events", 0) / measured.feedback
    print(f"    per feedback event (feedback_events) {size(feedback_row)}")
    print(f"    per reward (rewards)                {size(per.get('rewards', 0) / n)}")
    others = {n: b for n, b in per.items() if n not in ("samples", "feedback_events", "rewards")}
    for name, grew in sorted(others.items(), key=lambda item: -item[1]):
        print(f"    {name:<36}{size(grew / measured.completions)} per completion")
    print(
        f"  Kafka events on the wire              {size(measured.completion_event_bytes)} per "
        f"completion, {size(measured.feedback_event_bytes)} per feedback event "
        f"({measured.feedback_per_completion:.2f} per completion)"
    )
    (sample_cpu, event_cpu), (sample_pg, event_pg) = measured.worker_cpu_s, measured.postgres_cpu_s
    print(
        f"  worker CPU                            {sample_cpu * 1e6:,.0f} µs per completion, "
        f"{event_cpu * 1e6:,.0f} µs per feedback event "
        f"({1 / measured.cpu_per_completion(measured.worker_cpu_s):,.0f} completions/s per core)"
    )
    print(
        f"  Postgres CPU for those writes         {sample_pg * 1e6:,.0f} µs per completion, "
        f"{event_pg * 1e6:,.0f} µs per feedback event"
    )
    print(
        f"  one worker process, wall clock        {count(measured.worker_events_per_s)} events/s "
        f"(load average {psutil.getloadavg()[0]:.1f} on {psutil.cpu_count()} CPUs)"
    )
    print("\nassumptions (flags)")
    print(
        f"  tokens per completion {assume.prompt_tokens} prompt + {assume.completion_tokens} "
        f"generated; events per completion {1 + measured.feedback_per_completion:.2f} "
        f"(1 completion + {measured.feedback_per_completion:.2f} feedback)"
    )
    print(
        f"  peak-to-mean {assume.peak_to_mean:g}; each part sized to {assume.utilisation:.0%} "
        f"of its capacity at peak; Postgres retention {assume.retention_days} days, "
        f"Kafka {assume.kafka_retention_days} days"
    )
    print(
        f"  vLLM replica {count(assume.replica_tokens_per_s)} generated tokens/s; Kafka "
        f"partition {assume.partition_mb_per_s:g} MB/s"
    )
    streamed = gateway_cpu_s(assume)
    print(
        f"  gateway CPU {assume.gateway_cpu_ms:g} ms a completion + "
        f"{assume.gateway_cpu_ms_per_token:g} ms a streamed token: {streamed * 1000:.1f} ms a "
        f"streamed completion of {assume.completion_tokens} tokens, "
        f"{count(1 / streamed)} completions/s per core"
    )
    plans = [plan(volume, measured, assume) for volume in VOLUMES]
    rows = [
        ("requests a day", lambda p: f"{p.requests_per_day / 1e6:g} M"),
        ("peak completions/s", lambda p: count(p.peak_completions_per_s)),
        ("peak events/s (Kafka)", lambda p: count(p.peak_events_per_s)),
        ("Kafka partitions per topic", lambda p: str(p.kafka_partitions)),
        ("Kafka retained (3 replicas, before lz4)", lambda p: size(p.kafka_bytes_retained * 3)),
        ("worker processes (1 core each)", lambda p: str(p.worker_processes)),
        ("Postgres cores for the writes", lambda p: f"{p.postgres_write_cores:.2g}"),
        ("gateway processes", lambda p: str(p.gateway_processes)),
        ("vLLM replicas", lambda p: str(p.vllm_replicas)),
        ("Postgres growth per day", lambda p: size(p.postgres_bytes_per_day)),
        (f"Postgres at {assume.retention_days} days", lambda p: size(p.postgres_bytes_retained)),
        ("Postgres writes at peak", lambda p: size(p.postgres_write_bytes_per_s) + "/s"),
    ]
    print()
    print("| " + " | ".join(["", *(f"{v / 1e6:g} M/day" for v in VOLUMES)]) + " |")
    print("|---" * (len(VOLUMES) + 1) + "|")
    for label, cell in rows[1:]:
        print("| " + " | ".join([label, *(cell(p) for p in plans)]) + " |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--completions", type=int, default=1000, help="Completions stored.")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--completion-tokens", type=int, default=300)
    parser.add_argument("--peak-to-mean", type=float, default=3.0)
    parser.add_argument("--retention-days", type=int, default=30)
    parser.add_argument("--kafka-retention-days", type=int, default=3)
    parser.add_argument("--replica-tokens-per-s", type=float, default=2500.0)
    parser.add_argument(
        "--gateway-cpu-ms",
        type=float,
        default=GATEWAY_CPU_MS,
        help="gateway CPU per completion besides its streamed tokens",
    )
    parser.add_argument(
        "--gateway-cpu-ms-per-token",
        type=float,
        default=GATEWAY_CPU_MS_PER_TOKEN,
        help="gateway CPU per streamed chunk (a token each at vLLM's default stream interval)",
    )
    parser.add_argument("--partition-mb-per-s", type=float, default=5.0)
    parser.add_argument("--utilisation", type=float, default=0.6)
    args = parser.parse_args(argv)
    logging.getLogger("kafka").setLevel(logging.ERROR)
    assume = Assumptions(
        peak_to_mean=args.peak_to_mean,
        retention_days=args.retention_days,
        kafka_retention_days=args.kafka_retention_days,
        replica_tokens_per_s=args.replica_tokens_per_s,
        gateway_cpu_ms=args.gateway_cpu_ms,
        gateway_cpu_ms_per_token=args.gateway_cpu_ms_per_token,
        partition_mb_per_s=args.partition_mb_per_s,
        utilisation=args.utilisation,
        prompt_tokens=args.prompt_tokens,
        completion_tokens=args.completion_tokens,
    )
    with tempfile.TemporaryDirectory(prefix="rtrl-capacity-") as data_dir:
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
            measured = measure(stack, args.completions, args.prompt_tokens, args.completion_tokens)
        finally:
            stack.kafka.stop()
            stack.postgres.stop()
    report(measured, assume)


if __name__ == "__main__":
    main()
