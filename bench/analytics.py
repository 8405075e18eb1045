"""Experiment results latency on a million samples, while samples keep arriving.

Starts its own embedded Postgres, Kafka and Redis under a temporary directory, seeds one
running 90/10 experiment with --samples samples (and their final rewards) by COPY, builds
the analytics rollups once (timed), then calls, --repeat times each,
  service    the per-user reads and the statistics (`experiment_results`),
  endpoint   GET /analytics/experiments/{id}/results through the ASGI app,
  live       while --rate samples a second (with their final rewards) are written by
             another connection: a rollup refresh (`refresh_rollups`, which adds what
             arrived since the last one) followed by the endpoint, timed together,
and prints p50/p95 of each, and the cost of a refresh with nothing new. The target is p95
under 500 ms for `live`.

    python -m bench.analytics [--samples 1000000] [--users 20000] [--repeat 20] [--rate 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import statistics
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import orjson
import psycopg
from fastapi.testclient import TestClient
from sqlalchemy.ext.asyncio import async_sessionmaker

from app.abtest.rollups import refresh_rollups
from app.analytics.router import router as analytics_router
from app.analytics.schemas import Window
from app.analytics.service import experiment_results
from app.auth.service import new_api_key
from app.config import Settings
from app.db import make_async_engine, make_engine, session_scope
from app.main import create_app
from app.models import Arm, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus, Role
from bench._stack import scratch_stack

SAMPLE_COLUMNS = (
    "id, event_id, request_id, session_id, user_hash, checkpoint, experiment_id, arm, "
    "fallback, privacy, trainable, edit_requested, proposed_edit, clarifying_question, "
    "completion_token_ids, behaviour_logprobs, completion_chars, status, ttft_ms, latency_ms, "
    "tool_calls, malformed_tool_calls, served_at, created_at"
)
REWARD_COLUMNS = (
    "sample_id, served_at, components, reward, reward_version, due_at, finalized_at, updated_at"
)


def seed_registry(database_url: str) -> int:
    """Checkpoints `base` and `ckpt-1` and a running 90/10 experiment; returns its id."""
    engine = make_engine(database_url)
    with session_scope(engine) as session:
        now = datetime.now(UTC)
        base = Checkpoint(
            name="base", status=CheckpointStatus.production, base_model="tiny", published_at=now
        )
        canary = Checkpoint(name="ckpt-1", status=CheckpointStatus.canary, base_model="tiny")
        session.add_all([base, canary])
        session.flush()
        experiment = Experiment(
            name="bench",
            salt="bench",
            status=ExperimentStatus.running,
            started_at=now,
            arms=[
                Arm(name="control", checkpoint_id=base.id, weight_bps=9_000, is_control=True),
                Arm(name="treatment", checkpoint_id=canary.id, weight_bps=1_000),
            ],
        )
        session.add(experiment)
        session.flush()
        experiment_id = experiment.id
    engine.dispose()
    return experiment_id


@functools.cache
def population(users: int) -> list[str]:
    """The hashes of the bench's users, the same for the seed and the live arrivals."""
    return [
        uuid.UUID(int=int(u)).hex * 2 for u in np.random.default_rng(7).integers(0, 2**63, users)
    ]


def sample_chunks(
    n: int,
    users: int,
    experiment_id: int,
    chunk: int = 50_000,
    first_id: int = 1,
    start: datetime | None = None,
    span_s: float = 14 * 86_400,
    now: bool = False,
) -> Iterator[tuple[bytes, bytes]]:
    """COPY text of samples and their rewards, `chunk` rows at a time, served over `span_s`
    seconds from `start` (by default 14 days ago); with `now`, all served now."""
    start = start or datetime.now(UTC) - timedelta(days=14)
    tokens = "{" + ",".join(str(t) for t in range(64)) + "}"
    logprobs = "{" + ",".join("-0.5" for _ in range(64)) + "}"
    user_hashes = population(users)
    rng = np.random.default_rng(7 + first_id)
    # Seeded rows carry their own write times; live ones get the database's (as the workers').
    stamp = "" if now else "\t{}"
    for offset in range(0, n, chunk):
        size = min(chunk, n - offset)
        user = rng.integers(0, users, size)
        treatment = user % 10 == 0  # users are assigned, not requests: a tenth are treated
        latency = rng.lognormal(6.5, 0.6, size) * np.where(treatment, 1.05, 1.0)
        accepted = rng.random(size) < np.where(treatment, 0.42, 0.40)
        kept = np.where(accepted, rng.beta(4, 2, size), 0.0)
        followup = rng.random(size) < 0.3
        dissatisfied = rng.random(size) < 0.12
        tool_calls = (rng.random(size) < 0.2).astype(int)
        malformed = tool_calls * (rng.random(size) < 0.02)
        # Samples arrive in time order, as they do from the gateway.
        served = np.sort(rng.uniform(span_s * offset / n, span_s * (offset + size) / n, size))
        samples, rewards = [], []
        for i in range(size):
            sid = first_id + offset + i
            arm = "treatment" if treatment[i] else "control"
            checkpoint = "ckpt-1" if treatment[i] else "base"
            moment = datetime.now(UTC) if now else start + timedelta(seconds=float(served[i]))
            served_at = moment.isoformat()
            samples.append(
                f"{sid}\t{uuid.uuid4()}\tr-{sid}\ts-{user[i]}\t{user_hashes[user[i]]}\t"
                f"{checkpoint}\t{experiment_id}\t{arm}\tf\tf\tt\tt\tt\tf\t{tokens}\t{logprobs}\t"
                f"400\tok\t{latency[i] / 4:.1f}\t{latency[i]:.1f}\t{tool_calls[i]}\t"
                f"{malformed[i]}\t{served_at}{stamp.format(served_at)}\n"
            )
            components = {
                "edit_requested": True,
                "proposed_edit": True,
                "accepted": bool(accepted[i]),
                "kept": float(kept[i]),
                "survival_elapsed_s": 900.0,
                "dissatisfied": bool(dissatisfied[i]) if followup[i] else None,
                "latency_ms": float(latency[i]),
                "latency_over_budget": bool(latency[i] > 2000),
                "malformed_tool_calls": int(malformed[i]),
                "status": "ok",
            }
            reward = float(kept[i]) - 0.5 * bool(components["dissatisfied"])
            rewards.append(
                f"{sid}\t{served_at}\t{orjson.dumps(components).decode()}\t{reward}\t1\t{served_at}\t"
                f"{served_at}{stamp.format(served_at)}\n"
            )
        yield "".join(samples).encode(), "".join(rewards).encode()


def seed_samples(conninfo: str, n: int, users: int, experiment_id: int) -> float:
    """COPY n samples and rewards; returns the seconds it took."""
    started = time.perf_counter()
    with psycopg.connect(conninfo) as conn:
        # Seeding only: skip the rewards' foreign-key checks (the rows are made consistent).
        conn.execute("SET session_replication_role = replica")
        for sample_text, reward_text in sample_chunks(n, users, experiment_id):
            with conn.cursor().copy(f"COPY samples ({SAMPLE_COLUMNS}) FROM STDIN") as copy:
                copy.write(sample_text)
            with conn.cursor().copy(f"COPY rewards ({REWARD_COLUMNS}) FROM STDIN") as copy:
                copy.write(reward_text)
            conn.commit()
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE samples")
        conn.execute("VACUUM ANALYZE rewards")
    return time.perf_counter() - started


class Arrivals:
    """Writes `rate` samples a second (with final rewards) from another connection."""

    def __init__(self, conninfo: str, experiment_id: int, users: int, first_id: int, rate: int):
        self.conninfo, self.experiment_id, self.users = conninfo, experiment_id, users
        self.next_id, self.rate = first_id, rate
        self.written = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="arrivals", daemon=True)

    def __enter__(self) -> Arrivals:
        self.started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.elapsed = time.perf_counter() - self.started

    def _run(self) -> None:
        batch = max(1, self.rate // 20)  # every 50 ms, as a gateway's worker batches
        samples = SAMPLE_COLUMNS.removesuffix(", created_at")
        rewards = REWARD_COLUMNS.removesuffix(", updated_at")
        with psycopg.connect(self.conninfo, autocommit=True) as conn:
            conn.execute("SET session_replication_role = replica")
            due = time.perf_counter()
            while not self._stop.is_set():
                for sample_text, reward_text in sample_chunks(
                    batch, self.users, self.experiment_id, first_id=self.next_id, now=True
                ):
                    with conn.transaction():
                        with conn.cursor().copy(f"COPY samples ({samples}) FROM STDIN") as copy:
                            copy.write(sample_text)
                        with conn.cursor().copy(f"COPY rewards ({rewards}) FROM STDIN") as copy:
                            copy.write(reward_text)
                self.next_id += batch
                self.written += batch
                due += batch / self.rate
                self._stop.wait(max(0.0, due - time.perf_counter()))


def percentiles(timings: list[float]) -> str:
    ms = sorted(t * 1000 for t in timings)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):7.1f} ms   p95 {p95:7.1f} ms   (n={len(ms)})"


def timed(call: Callable[[], object], repeat: int) -> list[float]:
    call()  # warm caches and connections
    timings = []
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return timings


async def service_timings(database_url: str, experiment_id: int, repeat: int) -> list[float]:
    engine = make_async_engine(database_url)
    maker = async_sessionmaker(engine, expire_on_commit=False)
    timings = []
    for attempt in range(repeat + 1):
        started = time.perf_counter()
        async with maker() as session:
            await experiment_results(session, experiment_id, Window())
        if attempt:
            timings.append(time.perf_counter() - started)
    await engine.dispose()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--rate", type=int, default=1_000, help="samples a second, live")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as tmp:
        stack = scratch_stack(Path(tmp))
        stack.up()
        try:
            url = stack.postgres.url
            conninfo = url.replace("postgresql+psycopg://", "postgresql://")
            experiment_id = seed_registry(url)
            seconds = seed_samples(conninfo, args.samples, args.users, experiment_id)
            print(f"seeded {args.samples:,} samples + rewards by COPY in {seconds:.1f} s")

            engine = make_engine(url)
            started = time.perf_counter()
            refresh_rollups(engine)
            print(f"rollups built from scratch in {time.perf_counter() - started:.1f} s")
            with psycopg.connect(conninfo, autocommit=True) as conn:
                # What autovacuum does soon after in production: statistics for the planner.
                conn.execute("ANALYZE")
            print(f"refresh    {percentiles(timed(lambda: refresh_rollups(engine), 5))} (no news)")
            service = asyncio.run(service_timings(url, experiment_id, args.repeat))
            print(f"service    {percentiles(service)}")

            settings = Settings(
                data_dir=Path(tmp) / "gateway",
                database_url=stack.url("postgres"),
                kafka_bootstrap_servers=stack.url("kafka"),
                redis_url=stack.url("redis"),
                rate_limit_per_minute=100_000,
            )
            with session_scope(engine) as session:
                row, secret = new_api_key(name="bench-analyst", role=Role.analyst)
                session.add(row)
            app = create_app(settings)
            if not any(getattr(r, "path", "").startswith("/analytics") for r in app.routes):
                app.include_router(analytics_router)
            with TestClient(app) as client:
                headers = {"Authorization": f"Bearer {secret}"}
                path = f"/analytics/experiments/{experiment_id}/results"

                def call() -> None:
                    client.get(path, headers=headers).raise_for_status()

                print(f"endpoint   {percentiles(timed(call, args.repeat))}")

                def refresh_and_call() -> None:
                    refresh_rollups(engine)
                    call()

                arrivals = Arrivals(
                    conninfo, experiment_id, args.users, args.samples + 1, args.rate
                )
                with arrivals:
                    time.sleep(2)  # arrivals under way before the clock starts
                    live = timed(refresh_and_call, args.repeat)
                rate = arrivals.written / arrivals.elapsed
                print(
                    f"live       {percentiles(live)}  refresh + endpoint while"
                    f" {rate:,.0f} samples/s arrive ({arrivals.written:,} written)"
                )
                body = client.get(path, headers=headers).json()
                requests = sum(arm["requests"] for arm in body["arms"])
                users = sum(arm["users"] for arm in body["arms"])
                print(f"the results now count {requests:,} requests of {users:,} users")
            engine.dispose()
        finally:
            stack.down()


if __name__ == "__main__":
    main()
