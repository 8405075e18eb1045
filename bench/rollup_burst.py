"""The A/B rollups' refresh after a burst: how its time grows with the samples it touches.

Starts its own embedded Postgres under a temporary directory, seeds one running 90/10
experiment with --base samples (and their final rewards) by COPY, builds the rollups, runs
ANALYZE (as autovacuum does soon after in production), then for each burst size writes that
many new samples with final rewards in one go and times the one refresh that takes them in.
A refresh must cost time linear in what it touches: the last column divides each burst's
time by the smallest burst's, beside the ratio of their sizes (the baseline, in the same run,
is the same refresh on the smallest burst).

    python -m bench.rollup_burst [--base 200000] [--bursts 62500,250000,1000000] [--users 20000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import psycopg

from app.abtest.rollups import refresh_rollups
from app.db import make_engine, upgrade_schema
from bench._stack import scratch_stack
from bench.analytics import REWARD_COLUMNS, SAMPLE_COLUMNS, sample_chunks, seed_registry


def write_samples(
    conninfo: str, n: int, users: int, experiment_id: int, first_id: int, *, now: bool
) -> float:
    """COPY n samples and their final rewards from id `first_id`; returns the seconds."""
    started = time.perf_counter()
    with psycopg.connect(conninfo) as conn:
        # Seeding only: skip the rewards' foreign-key checks (the rows are made consistent).
        conn.execute("SET session_replication_role = replica")
        # Rows written now carry the database's write times, as the workers' do.
        samples = SAMPLE_COLUMNS.removesuffix(", created_at") if now else SAMPLE_COLUMNS
        rewards = REWARD_COLUMNS.removesuffix(", updated_at") if now else REWARD_COLUMNS
        chunks = sample_chunks(n, users, experiment_id, first_id=first_id, now=now)
        for sample_text, reward_text in chunks:
            with conn.cursor().copy(f"COPY samples ({samples}) FROM STDIN") as copy:
                copy.write(sample_text)
            with conn.cursor().copy(f"COPY rewards ({rewards}) FROM STDIN") as copy:
                copy.write(reward_text)
            conn.commit()
    return time.perf_counter() - started


def analyze(conninfo: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("ANALYZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=int, default=200_000, help="samples before the bursts")
    parser.add_argument("--bursts", default="62500,250000,1000000", help="burst sizes")
    parser.add_argument("--users", type=int, default=20_000)
    args = parser.parse_args()
    bursts = [int(size) for size in args.bursts.split(",")]

    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as tmp:
        stack = scratch_stack(Path(tmp))
        stack.postgres.start()
        try:
            url = stack.postgres.url
            upgrade_schema(url)
            conninfo = url.replace("postgresql+psycopg://", "postgresql://")
            experiment_id = seed_registry(url)
            seconds = write_samples(conninfo, args.base, args.users, experiment_id, 1, now=False)
            print(f"seeded {args.base:,} samples + rewards by COPY in {seconds:.1f} s")
            engine = make_engine(url)
            started = time.perf_counter()
            refresh_rollups(engine)
            print(f"rollups built from scratch in {time.perf_counter() - started:.1f} s")
            analyze(conninfo)

            print(f"{'burst':>10} {'refresh s':>10} {'x size':>7} {'x time':>7}")
            next_id, first = args.base + 1, None
            for size in bursts:
                write_samples(conninfo, size, args.users, experiment_id, next_id, now=True)
                next_id += size
                analyze(conninfo)
                started = time.perf_counter()
                touched = refresh_rollups(engine)
                elapsed = time.perf_counter() - started
                first = first or (size, elapsed)
                print(
                    f"{touched or 0:>10,} {elapsed:>10.2f} {size / first[0]:>7.1f} "
                    f"{elapsed / first[1]:>7.1f}",
                    flush=True,
                )
            engine.dispose()
        finally:
            stack.postgres.stop()


if __name__ == "__main__":
    main()
