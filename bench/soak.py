"""Soak: the whole embedded stack under steady simulator load, then its books and memory.

Starts its own stack (Postgres, Kafka, Redis, vLLM, a gateway, workers) in a scratch data
directory on free ports, drives it with simulated developers for `--minutes`, waits for
every reward to be final, and prints requests served, feedback events, rewards, lost and
duplicated records (both must be 0), client-side latency percentiles, and the memory
(RSS, whole process trees) of every process at the start of the load and at its end.
The first tenth of the requests is the baseline the last tenth is compared with: a leak or
a growing queue shows as latency and memory that climb from one to the other.

    python -m bench.soak [--minutes 30] [--users 12] [--workers 2] [--base-model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from sqlalchemy import func, select

from app.auth.service import new_api_key
from app.config import Settings
from app.db import make_engine, session_scope
from app.models import FeedbackEventRow, Reward, Role, Sample
from app.processes import process_tree
from bench._stack import scratch_settings
from rtrl.launcher import FullStack
from sandbox.simulator.books import read_books
from sandbox.simulator.report import SimulationReport
from sandbox.simulator.run import compressed_time_settings, simulate

TIME_SCALE = 0.01
"""The 15-minute survival report comes after 9 s."""


def tree_rss_mib(pid: int | None) -> float | None:
    """Resident memory of a process and all its children, in MiB; None when it is gone."""
    processes = process_tree(pid) if pid is not None else []
    if not processes:
        return None
    total = 0
    for process in processes:
        try:
            total += process.memory_info().rss
        except psutil.NoSuchProcess:
            continue
    return total / 2**20


@dataclass
class MemoryWatch:
    """RSS of each process tree, sampled every `interval_s` in a background thread."""

    pids: dict[str, int | None]
    interval_s: float = 30.0
    samples: dict[str, list[float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            rss = tree_rss_mib(pid)
            if rss is not None:
                self.samples.setdefault(name, []).append(rss)


def percentile(values: list[float], q: float) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 1000) - 1]


def duplicates(settings: Settings) -> int:
    """Rows beyond one per request (samples), per sample (rewards), per event (feedback)."""
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            extra = 0
            for column in (Sample.request_id, Reward.sample_id, FeedbackEventRow.event_id):
                total, distinct = session.execute(
                    select(func.count(), func.count(func.distinct(column)))
                ).one()
                extra += total - distinct
            return extra
    finally:
        engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="Load duration.")
    parser.add_argument("--users", type=int, default=12, help="Simulated developers.")
    parser.add_argument("--workers", type=int, default=2, help="Reward worker processes.")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests in flight.")
    parser.add_argument(
        "--base-model", type=Path, default=None, help="Base model dir (default: bootstrap one)."
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temp dir.")
    args = parser.parse_args()

    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="rtrl-soak-"))
    overrides = {"base_model": args.base_model} if args.base_model else {}
    settings = compressed_time_settings(scratch_settings(data_dir, **overrides), TIME_SCALE)
    stack = FullStack.from_settings(settings, workers=args.workers, trainer=False)
    print(f"soak: data in {data_dir}; starting the stack ...")
    stack.up()
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            row, key = new_api_key(
                name="soak", role=Role.ide, rate_limit_per_minute=1_000_000, created_by="soak"
            )
            session.add(row)
        pids = {
            "postgres": stack.services.postgres.pid(),
            "kafka": stack.services.kafka.pid(),
            "redis": stack.services.redis.pid(),
            "vllm": stack.vllm.pid() if stack.vllm else None,
            "gateway": stack.gateway.pid(),
            **{worker.name: worker.pid() for worker in stack.workers},
        }
        memory = MemoryWatch(pids)
        memory.start()
        duration_s = args.minutes * 60
        print(f"soak: {args.users} developers for {args.minutes:g} min ...")
        started = time.monotonic()
        last = [started]

        def progress(report: SimulationReport) -> None:
            if time.monotonic() - last[0] >= 60:
                last[0] = time.monotonic()
                print(
                    f"  {last[0] - started:.0f} s: {report.requests_ok} served,"
                    f" {report.requests_failed} failed",
                    flush=True,
                )

        report = simulate(
            stack.gateway_url,
            key,
            users=args.users,
            duration_s=duration_s,
            time_scale=TIME_SCALE,
            concurrency=args.concurrency,
            seed=7,
            progress=progress,
        )
        memory.stop()
        print("soak: load done; waiting for every reward to be final ...")
        books = read_books(engine, [report])
        deadline = time.monotonic() + 300
        while not books.balanced and time.monotonic() < deadline:
            time.sleep(2)
            books = read_books(engine, [report])
        extra = duplicates(settings)
    finally:
        engine.dispose()
        stack.down()

    latencies = [served.latency_s * 1000 for served in report.served]
    tenth = max(1, len(latencies) // 10)
    first, last_tenth = latencies[:tenth], latencies[-tenth:]
    lost = len(books.missing_samples) + len(books.unfinalized)
    lost_feedback = max(0, books.feedback_accepted - books.feedback_stored)
    print()
    print(f"duration               {report.wall_s / 60:.1f} min")
    print(f"requests served        {report.requests_ok}  (failed: {report.requests_failed})")
    print(
        f"feedback events        {books.feedback_accepted} accepted, {books.feedback_stored} stored"
    )
    print(f"rewards finalized      {books.served - len(books.unfinalized)}")
    print(f"lost                   {lost} completions, {lost_feedback} feedback events")
    print(f"duplicates             {extra}")
    print(f"orphan samples         {len(books.orphans)}")
    for label, values in (
        ("latency (client) ms", latencies),
        ("  first tenth", first),
        ("  last tenth", last_tenth),
    ):
        print(f"{label:<22} p50 {percentile(values, 0.5):.0f}  p99 {percentile(values, 0.99):.0f}")
    print("memory (RSS MiB)       start     end    peak")
    for name, values in memory.samples.items():
        print(f"  {name:<20} {values[0]:6.0f}  {values[-1]:6.0f}  {max(values):6.0f}")


if __name__ == "__main__":
    main()
