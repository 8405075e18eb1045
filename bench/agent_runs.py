"""Agent runs of a model, and of the same model with a checkpoint's adapter, on held-out tasks,
sampled offline with transformers at temperature 1 (as vLLM serves): solved runs, malformed
calls and first-turn questions, each checkpoint against the first.

The demo's A/B evaluation splits about 40 developers between two arms, so a cycle's interval
on kept edits spans ±15 pp; this gives an ML engineer the same runs, many more of them, from
the files a cycle published, without the stack. Runs are independent here (no users), so the
intervals are over runs. Each run is what `rtrl simulate --agent` does: the workspace's tools
declared, every call executed in the task's workspace and its result sent back, at most six
turns, the final file judged by the hidden checks.

    python -m bench.agent_runs [--model DIR] [--adapter DIR ...] [--runs 600] [--seed 11]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import scipy.stats
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from app.agent_tasks import agent_tasks
from app.config import get_settings
from trainer.agent_runs import AgentRun, run_agents


@dataclass
class Result:
    name: str
    runs: list[AgentRun] = field(default_factory=list)

    def share(self, values: list[bool]) -> tuple[float, int]:
        return (sum(values) / len(values) if values else 0.0), len(values)

    @property
    def solved(self) -> tuple[float, int]:
        return self.share([run.solved for run in self.runs])

    @property
    def questions(self) -> tuple[float, int]:
        return self.share([run.first_turn_question for run in self.runs])

    @property
    def malformed(self) -> tuple[float, int]:
        calls = sum(run.calls for run in self.runs)
        return (sum(run.malformed for run in self.runs) / calls if calls else 0.0), calls


def load(model_dir: Path, adapter: Path | None) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def difference(ours: tuple[float, int], theirs: tuple[float, int]) -> tuple[float, float, float]:
    """Difference of two shares over independent trials, with its 95% normal interval."""
    (p, n), (q, m) = ours, theirs
    gap = p - q
    se = (p * (1 - p) / max(n, 1) + q * (1 - q) / max(m, 1)) ** 0.5
    margin = float(scipy.stats.norm.ppf(0.975)) * se
    return gap, gap - margin, gap + margin


def report(results: list[Result]) -> str:
    metrics = (
        ("solved runs", "solved"),
        ("malformed calls", "malformed"),
        ("first-turn questions", "questions"),
    )
    lines = [f"{'checkpoint':<28}" + "".join(f"{label:<40}" for label, _ in metrics)]
    reference = results[0]
    for result in results:
        cells = []
        for _, attribute in metrics:
            value, count = getattr(result, attribute)
            cell = f"{value * 100:.1f}% of {count}"
            if result is not reference:
                gap, low, high = difference(
                    getattr(result, attribute), getattr(reference, attribute)
                )
                cell += f" ({gap * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}])"
            cells.append(f"{cell:<40}")
        lines.append(f"{result.name:<28}" + "".join(cells))
    lines.append("95% intervals over runs, against the first row")
    for result in results:
        by_operation: dict[str, list[bool]] = defaultdict(list)
        for run in result.runs:
            by_operation[run.task.task.operation].append(run.solved)
        shares = ", ".join(
            f"{name} {sum(v) / len(v):.0%}" for name, v in sorted(by_operation.items())
        )
        lines.append(f"{result.name}: solved by operation: {shares}")
    return "\n".join(lines)


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
        runs = run_agents(load(model_dir, adapter), tokenizer, tasks, seed=args.seed)
        results.append(Result(name, runs))
    print(report(results))


if __name__ == "__main__":
    main()
