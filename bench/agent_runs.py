"""Agent runs of a model, and of the same model with a checkpoint's adapter, on held-out tasks,
sampled offline with transformers at temperature 1 (as vLLM serves): solved runs, malformed
calls and first-turn questions, each checkpoint against the first.

The demo's A/B evaluation splits about 40 developers between two arms, so a cycle's interval
on kept edits spans ±15 pp; this gives an ML engineer the same runs, many more of them, from
the files a cycle published, without the stack. Runs are independent here (no users), so the
intervals are over runs: the delta method of the A/B results with each run as the unit, the
malformed share included (a run's calls are not independent of each other). Each run is what
`rtrl simulate --agent` does: the workspace's tools declared, every call executed in the
task's workspace and its result sent back, at most six turns, the final file judged by the
hidden checks.

    python -m bench.agent_runs [--model DIR] [--adapter DIR ...] [--runs 600] [--seed 11]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from app.config import get_settings
from sandbox.agent_runs import PolicyRuns, load_policy, run_agents, runs_table
from sandbox.agent_tasks import agent_tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="base model directory")
    parser.add_argument(
        "--adapter", type=Path, action="append", default=[], help="a checkpoint's adapter"
    )
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--split", choices=("heldout", "train", "all"), default="heldout")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be positive")
    model_dir = args.model or get_settings().base_model_path
    if not (model_dir / "config.json").exists():
        parser.error(f"no model at {model_dir}; run `rtrl model bootstrap` or pass --model")
    for adapter in args.adapter:
        if not (adapter / "adapter_config.json").exists():
            parser.error(f"no adapter at {adapter}")
    torch.set_num_threads(args.threads)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tasks = agent_tasks(args.seed, args.runs, args.split)
    results = []
    for adapter in [None, *args.adapter]:
        name = "base" if adapter is None else adapter.name
        print(f"{name}: {args.runs} agent runs on {args.split} tasks ...", flush=True)
        runs = run_agents(load_policy(model_dir, adapter), tokenizer, tasks, seed=args.seed)
        results.append(PolicyRuns(name, runs))
    print(runs_table(results))


if __name__ == "__main__":
    main()
