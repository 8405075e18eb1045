"""Agent learning through the stack: the demo's cycles on the shipped default base, each
candidate promoted without its canary, then held-out agent runs sampled offline per model.

Each cycle serves `--users` developers' agent runs on production (vLLM, gateway, Kafka, a
worker), finalizes their rewards and trains with the demo's settings and gate; its
candidate becomes production (the canary's served A/B, about 100 runs an arm, cannot resolve
one cycle's gain, so it is skipped). Base and the final checkpoint then run the same
`--runs` held-out tasks with the same random stream; solved runs are compared task by task
(a paired t-test: runs of one task correlate, 0.2-0.3 measured) and the share of malformed
calls over runs. Exit 0 when solved runs rose beyond their 95% interval and malformed calls
fell, 1 otherwise; the figures are printed either way.

`rtrl demo` runs the same cycles with their canaries and judges 400 runs a model; this is the
larger offline judgement, on its own stack in a temporary data dir (ports are free ones).

    python -m bench.agent_learning [--cycles 2] [--users 24] [--runs 1200] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import scipy.stats

from app.db import make_engine
from bench._stack import scratch_settings
from rtrl.demo import (
    DemoConfig,
    Ops,
    create_keys,
    demo_train_config,
    offline_comparison,
    production_name,
    train_candidate,
)
from rtrl.launcher import FullStack
from sandbox.agent_runs import compare_runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=2, help="Training cycles.")
    parser.add_argument("--users", type=int, default=24, help="Developers per cycle.")
    parser.add_argument("--runs", type=int, default=1200, help="Held-out runs per model.")
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temp dir.")
    args = parser.parse_args()
    if args.cycles < 1 or args.users < 1 or args.runs < 2:
        parser.error("--cycles and --users must be positive, --runs at least 2")

    started = time.monotonic()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="rtrl-agent-learning-"))
    settings = scratch_settings(data_dir)
    config = DemoConfig(
        cycles=args.cycles,
        train_users=args.users,
        progress_bars=False,
        train=demo_train_config(agent=True),
    )
    print(f"agent learning: data in {data_dir}; starting the stack ...", flush=True)
    stack = FullStack.from_settings(settings, workers=1, trainer=False, progress=print)
    stack.up()
    engine = make_engine(settings.database_url)
    try:
        keys = create_keys(engine)
        ops = Ops(stack.gateway_url, keys.ops)
        ops.stop_all()
        for cycle in range(1, config.cycles + 1):
            record = train_candidate(
                engine, settings, stack.gateway_url, keys, config, cycle, print
            )
            if record.candidate is not None:
                refusal = ops.promote(record.candidate)
                if refusal is not None:
                    print(f"  {record.candidate} not promoted: {refusal}")
                ops.stop_all()
        final = production_name(engine)
        if final == "base":
            print("no cycle's candidate passed the trainer's gate: nothing to compare")
            sys.exit(1)
        base, trained = offline_comparison(
            engine, settings, "base", final, args.runs, print, bars=False
        )
    finally:
        engine.dispose()
        stack.down()

    paired = scipy.stats.ttest_rel(
        [float(run.solved) for run in trained.runs], [float(run.solved) for run in base.runs]
    )
    interval = paired.confidence_interval(0.95)
    solved = (sum(r.solved for r in trained.runs) - sum(r.solved for r in base.runs)) / args.runs
    malformed = compare_runs(trained.runs, base.runs, "malformed")
    print()
    print(
        f"solved runs, {final} - base, paired over {args.runs} tasks: {solved * 100:+.1f} pp"
        f" [{interval.low * 100:+.1f}, {interval.high * 100:+.1f}]"
    )
    if malformed is not None:
        bounds = (
            f" [{malformed.ci_low * 100:+.1f}, {malformed.ci_high * 100:+.1f}]"
            if malformed.ci_low is not None and malformed.ci_high is not None
            else ""
        )
        print(
            f"malformed calls, {final} - base, over runs: {malformed.difference * 100:+.1f} pp"
            + bounds
        )
    print(f"wall time              {(time.monotonic() - started) / 60:.1f} min")
    learned = interval.low > 0 and malformed is not None and malformed.difference < 0
    print("learned: yes" if learned else "learned: NO")
    sys.exit(0 if learned else 1)


if __name__ == "__main__":
    main()
