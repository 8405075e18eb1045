"""The demo's verdict across seeds: `rtrl demo` (what `make demo` runs) on several seeds.

Each seed is one `rtrl demo --seed N` from an empty data directory of its own, with its
embedded Postgres, Kafka, Redis, vLLM and gateway on free ports, run one after another (each
takes the machine's cores). Seed 0 is the documented demo; another seed draws other training
tasks, developers, evaluations and offline runs (`DemoConfig.seed`). The shipped base, the
demo's training settings and any `RTRL_TRAIN_*` set in the environment are the same for all.

For each seed it prints the exit code (0: the final checkpoint is shown better than base; 2:
it is not), the minutes taken, and the demo's own lines that carry the verdict: each cycle's
update (where it stopped, the KL to production it reached), the gate's held-out pass rate and
KL, the decision, the cycles' table, the final comparison and the lineage. Then the count of
seeds that exited 0. Each seed's whole output is kept in `--logs`.

    python -m bench.demo_seeds [--seeds 10] [--first 0] [--logs DIR] [-- extra rtrl demo args]

One seed took 12-13 minutes on the 2-core machine, so ten take about two hours.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from app.processes import free_port

RTRL = Path(sys.executable).parent / "rtrl"
"""The `rtrl` command of this environment: what `make demo` runs."""
VERDICT_LINES = re.compile(
    r"=== cycle|stopped after|KL to production|no checkpoint this cycle|promot|rolled back"
    r"|^cycles \(|^cycle\s+formula|^\d+\s+\d+\s+(ckpt-\d+|-)\s|=== summary|solved|kept rate"
    r"|^lineage|demo finished"
)


@dataclass
class SeedRun:
    seed: int
    exit_code: int
    minutes: float
    lines: list[str]
    log: Path


def run_seed(seed: int, logs: Path, extra: list[str]) -> SeedRun:
    """`rtrl demo --seed seed` on a data dir and ports of its own; its output in `logs`."""
    log = logs / f"seed-{seed}.log"
    with tempfile.TemporaryDirectory(prefix=f"rtrl-demo-seed-{seed}-") as data_dir:
        env = os.environ | {
            "RTRL_DATA_DIR": data_dir,
            "RTRL_EMBEDDED_POSTGRES_PORT": str(free_port()),
            "RTRL_EMBEDDED_KAFKA_PORT": str(free_port()),
            "RTRL_EMBEDDED_REDIS_PORT": str(free_port()),
            "RTRL_EMBEDDED_VLLM_PORT": str(free_port()),
            "RTRL_GATEWAY_PORT": str(free_port()),
        }
        command = [str(RTRL), "demo", "--seed", str(seed), *extra]
        started = time.monotonic()
        with log.open("w") as out:
            done = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT)
        minutes = (time.monotonic() - started) / 60
    lines = [line.rstrip() for line in log.read_text().splitlines() if VERDICT_LINES.search(line)]
    return SeedRun(seed, done.returncode, minutes, lines, log)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="how many seeds")
    parser.add_argument("--first", type=int, default=0, help="the first seed")
    parser.add_argument("--logs", type=Path, help="where each seed's output goes (a temp dir)")
    parser.add_argument("extra", nargs="*", help="more `rtrl demo` arguments, after --")
    args = parser.parse_args()
    logs = args.logs or Path(tempfile.mkdtemp(prefix="rtrl-demo-seeds-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"rtrl demo on seeds {args.first}..{args.first + args.seeds - 1}; logs in {logs}")
    runs: list[SeedRun] = []
    for seed in range(args.first, args.first + args.seeds):
        run = run_seed(seed, logs, args.extra)
        runs.append(run)
        print(f"\n--- seed {seed}: exit {run.exit_code} after {run.minutes:.1f} min ({run.log})")
        for line in run.lines:
            print(f"  {line}")
        sys.stdout.flush()
    passed = sum(run.exit_code == 0 for run in runs)
    print(
        f"\nexit 0 in {passed} of {len(runs)} seeds: "
        + ", ".join(f"{run.seed}:{run.exit_code}" for run in runs)
    )


if __name__ == "__main__":
    main()
