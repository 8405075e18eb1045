"""Agent traffic through the whole stack, with rtrl's vLLM plugin and without it.

Starts its own embedded stack (Postgres, Kafka, Redis, vLLM on `--model`, the gateway and
one reward worker), then, in rotating order for `--rounds` rounds, restarts vLLM

  rtrl    with `app.serving.vllm_plugin` (LoRA kernels that multiply once per adapter in
          the batch), as `rtrl up` and `rtrl demo` start it;
  stock   with `VLLM_PLUGINS=none`: vLLM's own CPU LoRA kernels;

and runs the same simulated developers (`rtrl simulate --agent`, the same seed every time:
the same tasks, sessions and think times) against the gateway. Each variant does the same
work from the same clock start: the simulator's first request to its last feedback. It
prints, per run, the wall time, requests served (sampling differs, so the count does too),
wall time per 100 requests, mean request latency, and the CPU-seconds of the vLLM processes
and of the rest of the stack.

Stock vLLM applies the last LoRA slot's adapter to base-model tokens once every slot is
full; here no adapter is loaded, so both variants serve the base model alone.

    python -m bench.agent_serving [--model DIR] [--users 24] [--sessions 2]
                                  [--concurrency 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from app.auth.service import new_api_key
from app.config import Settings
from app.db import make_engine, session_scope
from app.embedded.process import free_port, process_tree
from app.launcher import FullStack
from app.models import Role
from app.simulator import simulate
from bench.serving import base_model, load_average

VARIANTS = ("rtrl", "stock")


@dataclass
class Run:
    variant: str
    wall_s: float
    requests: int
    latency_ms: float
    vllm_cpu_s: float
    rest_cpu_s: float

    @property
    def per_100_s(self) -> float:
        return self.wall_s / max(self.requests, 1) * 100


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        for process in process_tree(pid):
            try:
                times = process.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
    return total


def restart_vllm(stack: FullStack, variant: str) -> None:
    assert stack.vllm is not None
    stack.vllm.stop()
    if variant == "stock":
        os.environ["VLLM_PLUGINS"] = "none"
    else:
        os.environ.pop("VLLM_PLUGINS", None)
    started = time.monotonic()
    stack.vllm.start()
    print(f"  vLLM ({variant}) healthy after {time.monotonic() - started:.0f} s", flush=True)


def one_run(stack: FullStack, key: str, variant: str, args: argparse.Namespace) -> Run:
    assert stack.vllm is not None
    vllm_pid = stack.vllm.pid()
    assert vllm_pid is not None
    rest = [
        pid
        for pid in (
            stack.gateway.pid(),
            *(worker.pid() for worker in stack.workers),
            stack.services.postgres.pid(),
            stack.services.kafka.pid(),
            stack.services.redis.pid(),
        )
        if pid is not None
    ]
    vllm_before, rest_before = cpu_seconds([vllm_pid]), cpu_seconds(rest)
    report = simulate(
        stack.gateway_url,
        key,
        users=args.users,
        sessions_per_user=args.sessions,
        tasks_per_session=args.tasks,
        time_scale=0.01,
        seed=args.seed,
        split="train",
        concurrency=args.concurrency,
        agent=True,
    )
    served = report.served
    run = Run(
        variant=variant,
        wall_s=report.wall_s,
        requests=report.requests_ok,
        latency_ms=statistics.fmean(r.latency_s for r in served) * 1000 if served else 0.0,
        vllm_cpu_s=cpu_seconds([vllm_pid]) - vllm_before,
        rest_cpu_s=cpu_seconds(rest) - rest_before,
    )
    print(
        f"  {variant:5}  {run.wall_s:6.1f} s  {run.requests:5d} requests"
        f"  {run.per_100_s:5.1f} s/100  latency {run.latency_ms:5.0f} ms"
        f"  vLLM {run.vllm_cpu_s:5.1f} CPU-s  rest {run.rest_cpu_s:5.1f} CPU-s"
        f"  ({report.requests_failed} failed; {load_average()})",
        flush=True,
    )
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="Default: bootstrap one.")
    parser.add_argument("--users", type=int, default=24, help="Simulated developers.")
    parser.add_argument("--sessions", type=int, default=2, help="Sessions per developer.")
    parser.add_argument("--tasks", type=int, default=5, help="Agent tasks per session.")
    parser.add_argument("--concurrency", type=int, default=8, help="Requests in flight.")
    parser.add_argument("--rounds", type=int, default=2, help="Runs per variant.")
    parser.add_argument("--seed", type=int, default=1, help="The simulated population.")
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="rtrl-agent-serving-"))
    settings = Settings(
        data_dir=scratch,
        base_model=base_model(args.model, scratch),
        embedded_postgres_port=free_port(),
        embedded_kafka_port=free_port(),
        embedded_redis_port=free_port(),
        embedded_vllm_port=free_port(),
        gateway_port=free_port(),
    )
    stack = FullStack.from_settings(settings, workers=1, trainer=False)
    print(f"agent serving: data in {scratch}; starting the stack ...", flush=True)
    stack.up()
    engine = make_engine(settings.database_url)
    try:
        with session_scope(engine) as session:
            row, key = new_api_key(
                name="bench", role=Role.ide, rate_limit_per_minute=1_000_000, created_by="bench"
            )
            session.add(row)
        print(
            f"{args.users} developers x {args.sessions} sessions x {args.tasks} agent tasks,"
            f" {args.concurrency} requests in flight, seed {args.seed}",
            flush=True,
        )
        runs: list[Run] = []
        for round_number in range(args.rounds):
            order = VARIANTS if round_number % 2 == 0 else VARIANTS[::-1]
            print(f"round {round_number + 1}/{args.rounds}", flush=True)
            for variant in order:
                restart_vllm(stack, variant)
                runs.append(one_run(stack, key, variant, args))
        print("\nmedian over rounds:")
        medians = {}
        for variant in VARIANTS:
            mine = [run for run in runs if run.variant == variant]
            medians[variant] = statistics.median(run.per_100_s for run in mine)
            print(
                f"  {variant:5}  {medians[variant]:5.1f} s per 100 requests,"
                f" latency {statistics.median(r.latency_ms for r in mine):5.0f} ms,"
                f" vLLM {statistics.median(r.vllm_cpu_s / r.requests * 1000 for r in mine):4.0f}"
                f" CPU-ms per request"
            )
        print(f"  rtrl / stock time per request: {medians['rtrl'] / medians['stock']:.2f}")
    finally:
        engine.dispose()
        os.environ.pop("VLLM_PLUGINS", None)
        stack.down()


if __name__ == "__main__":
    main()
