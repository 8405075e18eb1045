"""Predicted against realized A/Bs: the demo's cycles on several seeds and both scenarios.

Each run is `rtrl demo` on its own stack and data dir (free ports): every cycle's candidate is
predicted from production's logs before its canary (`trainer.prediction`), then its canary
serves held-out traffic and the A/B is read; the reward-hacking scenario adds candidates made
worse on purpose (trained under the flawed formula 0). At the end, over every candidate and
metric with a realized difference: how often the sign agreed, how often the realized
difference fell inside the predicted interval (and within both intervals' combined error:
the canary's A/B is itself noisy), and how often the diagnostics said "unreliable".

    python -m bench.prediction [--seeds 3] [--scenarios learning reward-hacking] [--cycles 2]

About 12 minutes a run on a 2-core CPU machine (a run is a whole demo).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._stack import scratch_settings
from rtrl.demo import SCENARIO_CYCLES, DemoConfig, Scenario, demo_train_config, run_demo

METRICS = ("mean_reward", "kept", "malformed_call_rate", "dissatisfied_rate")


def one_run(scenario: Scenario, seed: int, cycles: int | None) -> list[dict[str, Any]]:
    """The scoreboard records of one demo run, each labelled with its scenario and seed."""
    data_dir = Path(tempfile.mkdtemp(prefix=f"rtrl-prediction-{scenario}-{seed}-"))
    settings = scratch_settings(data_dir)
    train = demo_train_config(agent=True, scenario=scenario).model_copy(update={"seed": seed})
    config = DemoConfig(
        cycles=cycles or SCENARIO_CYCLES[scenario],
        scenario=scenario,
        progress_bars=False,
        offline_runs=0,
        train=train,
    )
    print(f"\n=== {scenario}, seed {seed}: data in {data_dir}", flush=True)
    summary = run_demo(settings, config, progress=lambda line: print(line, flush=True))
    return [
        record | {"scenario": scenario, "seed": seed}
        for record in summary.predictions.get("records", [])
    ]


def share(flags: list[bool | None]) -> str:
    known = [flag for flag in flags if flag is not None]
    return f"{sum(known) / len(known):.0%} of {len(known)}" if known else "-"


def report(records: list[dict[str, Any]]) -> None:
    print(
        "\nscenario        seed candidate  metric              predicted          realized"
        "          sign in-CI consistent trust"
    )
    for record in records:
        for metric in record["metrics"]:
            realized = "-" if metric["realized"] is None else f"{metric['realized']:+.3f}"
            flags = [
                "-" if metric[name] is None else ("yes" if metric[name] else "no")
                for name in ("sign_agrees", "realized_in_interval", "consistent")
            ]
            candidate = record["checkpoint"] or record["status"]
            print(
                f"{record['scenario']:<15} {record['seed']:>4} {candidate:<10}"
                f" {metric['metric']:<19} {metric['predicted']:+.3f}"
                f" [{_bound(metric['predicted_ci_low'])}, {_bound(metric['predicted_ci_high'])}]"
                f" {realized:<17} {flags[0]:<4} {flags[1]:<5} {flags[2]:<10}"
                f" {'reliable' if metric['reliable'] else 'unreliable'}"
            )
    print("\nover every candidate whose canary realized the metric:")
    for name in METRICS:
        scored = [
            metric
            for record in records
            for metric in record["metrics"]
            if metric["metric"] == name and metric["realized"] is not None
        ]
        reliable = [metric for metric in scored if metric["reliable"]]
        inside = share([m["realized_in_interval"] for m in reliable])
        print(
            f"  {name:<19} unreliable {share([not m['reliable'] for m in scored])};"
            f" reliable ones: sign agreed {share([m['sign_agrees'] for m in reliable])},"
            f" realized in the predicted interval {inside},"
            f" consistent with both intervals {share([m['consistent'] for m in reliable])}"
        )


def _bound(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3, help="Training seeds per scenario.")
    parser.add_argument(
        "--scenarios",
        nargs="+",
        default=["learning", "reward-hacking"],
        choices=sorted(SCENARIO_CYCLES),
        help="Demo scenarios to run.",
    )
    parser.add_argument("--cycles", type=int, default=None, help="Default: the scenario's own.")
    args = parser.parse_args()
    if args.seeds < 1:
        parser.error("--seeds must be at least 1")
    started = time.monotonic()
    records = [
        record
        for scenario in args.scenarios
        for seed in range(args.seeds)
        for record in one_run(scenario, seed, args.cycles)
    ]
    report(records)
    print(f"\nwall time {(time.monotonic() - started) / 60:.1f} min")


if __name__ == "__main__":
    main()
