"""The trainer's learning signal, former against current: the demo's first agent cycle on
several seeds of traffic (the same base), each seed's batch trained once per variant.

A variant is a baseline, a KL weight and optionally a layout: `batch:0` is the former signal
(each reward against its prompt's mean, else the batch mean, and no KL term), `state:0.05` the
per-state baseline with the KL to production at 0.05, `state:0.05:stepwise` the same with each
turn fed as a row of its own instead of a run's turns merged into one sequence (the default
layout, `merged`). For each seed, `--users` developers' agent runs are served
on the base through the real stack (vLLM, gateway, Kafka, a worker) with that seed, their
rewards finalized, and every variant trains a fresh LoRA on the same batch with the demo's
settings and that seed, as the cycle's update does (no gate, nothing published). Each
candidate then runs the same `--runs` held-out agent tasks as the base (the same random
stream), and the trainer's own logprob function scores the held-out reference runs' turns.

Per seed: the batch (its runs, and the tokens each layout feeds), and each baseline's mean
advantage by turn of the run. Per seed and
variant: the gain in held-out solved runs over the base (pp), malformed calls
before (base) and after, the mean per-token probability under production (the base) and the
candidate of the end token after "Done." and of the tool names' tokens (`read_file`,
`edit_file`), and the gate's KL to production on one-turn answers and on agent turns; then
each variant's mean gain and its spread (standard deviation) over seeds, and the update's
wall time (drift recomputation and optimizer loop).

    python -m bench.baseline [--seeds 5] [--users 24] [--runs 800] \\
        [--variants batch:0,state:0.05] [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import torch
from sqlalchemy import Engine, select
from transformers import PreTrainedTokenizerFast

from app.config import Settings
from app.db import make_engine, session_scope
from app.models import Checkpoint, CheckpointStatus
from app.serving.parity import completion_logprobs
from bench._stack import scratch_settings
from rtrl.demo import (
    OFFLINE_SEED,
    DemoConfig,
    Ops,
    create_keys,
    demo_train_config,
    run_traffic,
    served_line,
    wait_for_rewards,
)
from rtrl.launcher import FullStack
from sandbox.agent_runs import PolicyRuns, load_policy, run_agents
from sandbox.agent_tasks import agent_tasks
from sandbox.task_family import EVAL_SEED, agent_reference_batch, reference_batch, reference_turns
from sandbox.tasks import heldout_tasks
from trainer.config import Baseline, Layout, TrainConfig
from trainer.data import TrainingSample, select_on_policy_batch
from trainer.evaluate import kl_to_production, trainable_state
from trainer.loss import advantages
from trainer.policy import load_trainable_policy
from trainer.sequences import layout_rows
from trainer.update import sharded_logprobs, update_policy

PROBED_TOOLS = ("read_file", "edit_file")
REFERENCE_TASKS = 64
"""Held-out agent tasks whose reference runs are scored (three turns each)."""


@dataclass(frozen=True)
class Variant:
    baseline: Baseline
    kl_coef: float
    layout: Layout = "merged"

    @property
    def name(self) -> str:
        name = f"{self.baseline}:{self.kl_coef:g}"
        return name if self.layout == "merged" else f"{name}:{self.layout}"

    @classmethod
    def parse(cls, text: str) -> Variant:
        baseline, _, rest = text.partition(":")
        kl_coef, _, layout = rest.partition(":")
        if baseline not in ("batch", "state"):
            raise ValueError(f"unknown baseline {baseline!r} (batch or state)")
        if layout not in ("", "merged", "stepwise"):
            raise ValueError(f"unknown layout {layout!r} (merged or stepwise)")
        return cls(cast(Baseline, baseline), float(kl_coef or 0), cast(Layout, layout or "merged"))


@dataclass(frozen=True)
class FormattingTokens:
    """The held-out reference runs' turns, and where in their answers the formatting tokens
    lie: the end token of a final answer "Done.", and each tool's name in a call."""

    prompts: list[list[int]]
    answers: list[list[int]]
    positions: dict[str, list[tuple[int, int]]]
    """Label -> (turn, answer token) of each such token."""


def formatting_tokens(tokenizer: PreTrainedTokenizerFast, tasks: int) -> FormattingTokens:
    turns = reference_turns(tokenizer, agent_tasks(EVAL_SEED, tasks, "heldout"))
    positions: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for turn, (_, answer) in enumerate(turns):
        text = tokenizer.decode(answer)
        if text == f"Done.{tokenizer.eos_token}":
            positions["end after Done."].append((turn, len(answer) - 1))
        for name in PROBED_TOOLS:
            marker = f'"name": "{name}"'
            if marker not in text:
                continue
            start = text.index(marker) + len(marker) - len(name) - 1
            ends = [len(tokenizer.decode(answer[: k + 1])) for k in range(len(answer))]
            for k, end in enumerate(ends):
                if end > start and (ends[k - 1] if k else 0) < start + len(name):
                    positions[name].append((turn, k))
    return FormattingTokens(
        [prompt for prompt, _ in turns], [answer for _, answer in turns], dict(positions)
    )


def token_probabilities(policy: torch.nn.Module, probe: FormattingTokens) -> dict[str, float]:
    """Mean per-token probability of each kind of formatting token under `policy`."""
    logprobs = completion_logprobs(policy, probe.prompts, probe.answers, max_batch_tokens=8192)
    return {
        label: sum(torch.tensor(logprobs[t][k]).exp().item() for t, k in spots) / len(spots)
        for label, spots in probe.positions.items()
    }


@dataclass
class Outcome:
    seed: int
    variant: str
    solved: float
    malformed: float
    probabilities: dict[str, float]
    kl_answers: float
    kl_agent_turns: float
    update_kl: float
    update_seconds: float
    """Drift recomputation and the optimizer loop."""
    seconds: float


def serve_first_cycle(
    engine: Engine,
    settings: Settings,
    gateway: str,
    ide_key: str,
    config: DemoConfig,
    seed: int,
) -> list[TrainingSample]:
    """The demo's first cycle's traffic on the base with this seed, its rewards finalized:
    the on-policy batch it leaves (only what this seed served)."""
    started = datetime.now(UTC)
    report = run_traffic(
        gateway,
        ide_key,
        config,
        label="training traffic",
        users=config.train_users,
        sessions=config.train_sessions,
        seed=seed,
        split="train",
        concurrency=config.concurrency,
    )
    print(served_line(report), flush=True)
    wait_for_rewards(engine, [r.request_id for r in report.served], print)
    with session_scope(engine) as session:
        production = session.scalar(
            select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production)
        )
        assert production is not None and production.name == "base"
        batch = select_on_policy_batch(session, production, max_samples=config.train.max_samples)
    return [s for s in batch.samples if s.served_at >= started]


def layouts_line(samples: list[TrainingSample]) -> str:
    """The batch's runs, and the rows and tokens each layout feeds it as."""
    runs = {s.trajectory_id for s in samples if s.trajectory_id is not None}
    merged, stepwise = layout_rows(samples, "merged"), layout_rows(samples, "stepwise")
    return (
        f"{len(runs)} runs; step-wise {len(stepwise.rows)} rows, {stepwise.tokens_fed} tokens; "
        f"merged {len(merged.rows)} rows, {merged.tokens_fed} tokens "
        f"({stepwise.tokens_fed / max(merged.tokens_fed, 1):.1f}x fewer), "
        f"{merged.breaks} breaks"
    )


def offsets_by_turn(samples: list[TrainingSample]) -> str:
    """Each baseline's mean advantage per turn of the run (0, 1, 2, 3+), in σ: the offset a
    turn carries whatever it answered."""
    turns = torch.tensor([min(s.turn_index, 3) for s in samples])
    cells = []
    baselines: tuple[Baseline, ...] = ("batch", "state")
    for baseline in baselines:
        advantage = advantages(samples, baseline)
        means = [
            f"{float(advantage[turns == turn].mean()):+.2f}" if bool((turns == turn).any()) else "-"
            for turn in range(4)
        ]
        cells.append(f"{baseline} {'/'.join(means)}")
    return "mean advantage by turn 0/1/2/3+: " + ", ".join(cells)


def train_and_judge(
    settings: Settings,
    samples: list[TrainingSample],
    config: TrainConfig,
    variant: Variant,
    probe: FormattingTokens,
    runs: int,
    tokenizer: PreTrainedTokenizerFast,
) -> tuple[Outcome, PolicyRuns]:
    """A fresh LoRA on the base trained on `samples` as the cycle's update trains it, then
    judged on held-out agent runs, the formatting tokens and the gate's KL."""
    started = time.monotonic()
    config = config.model_copy(
        update={"baseline": variant.baseline, "kl_coef": variant.kl_coef, "layout": variant.layout}
    )
    torch.manual_seed(config.seed)
    device = torch.device("cpu")
    policy = load_trainable_policy(settings.base_model_path, None, config, device)
    production_weights = trainable_state(policy)
    update_started = time.perf_counter()
    old = sharded_logprobs(policy, samples, config)
    stats = update_policy(policy, samples, old, config, device, lambda line: None)
    update_seconds = time.perf_counter() - update_started
    probabilities = token_probabilities(policy, probe)
    answers = reference_batch(tokenizer, heldout_tasks(EVAL_SEED, config.eval_tasks))
    agent_turns = agent_reference_batch(tokenizer, config.eval_tasks)
    assert agent_turns is not None
    kl_answers = kl_to_production(policy, production_weights, answers)
    kl_agent = kl_to_production(policy, production_weights, agent_turns)
    merged = policy.merge_and_unload().eval()
    judged = PolicyRuns(
        variant.name,
        run_agents(
            merged, tokenizer, agent_tasks(OFFLINE_SEED, runs, "heldout"), seed=OFFLINE_SEED
        ),
    )
    outcome = Outcome(
        seed=config.seed,
        variant=variant.name,
        solved=judged.rate("solved")[0],
        malformed=judged.rate("malformed")[0],
        probabilities=probabilities,
        kl_answers=kl_answers,
        kl_agent_turns=kl_agent,
        update_kl=float(stats["kl_to_production"]),
        update_seconds=update_seconds,
        seconds=time.monotonic() - started,
    )
    return outcome, judged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="Seeds of traffic (1..N).")
    parser.add_argument("--users", type=int, default=24, help="Developers per seed's cycle.")
    parser.add_argument("--runs", type=int, default=800, help="Held-out runs per model.")
    parser.add_argument(
        "--variants",
        default="batch:0,state:0.05",
        help="Comma-separated baseline:kl_coef pairs; the first is the reference.",
    )
    parser.add_argument("--data-dir", type=Path, default=None, help="Default: a temp dir.")
    args = parser.parse_args()
    variants = [Variant.parse(v) for v in args.variants.split(",")]
    if args.seeds < 1 or args.users < 1 or args.runs < 2:
        parser.error("--seeds and --users must be positive, --runs at least 2")

    started = time.monotonic()
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="rtrl-baseline-"))
    settings = scratch_settings(data_dir)
    config = DemoConfig(
        cycles=1, train_users=args.users, progress_bars=False, train=demo_train_config(agent=True)
    )
    torch.set_num_threads(config.train.threads or torch.get_num_threads())
    print(f"baseline bench: data in {data_dir}; starting the stack ...", flush=True)
    stack = FullStack.from_settings(settings, workers=1, trainer=False, progress=print)
    stack.up()
    engine = make_engine(settings.database_url)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(settings.base_model_path)
    probe = formatting_tokens(tokenizer, REFERENCE_TASKS)
    tasks = agent_tasks(OFFLINE_SEED, args.runs, "heldout")
    outcomes: list[Outcome] = []
    try:
        keys = create_keys(engine)
        Ops(stack.gateway_url, keys.ops).stop_all()
        base = load_policy(settings.base_model_path)
        base_probabilities = token_probabilities(base, probe)
        base_runs = PolicyRuns("base", run_agents(base, tokenizer, tasks, seed=OFFLINE_SEED))
        base_solved, base_malformed = base_runs.rate("solved")[0], base_runs.rate("malformed")[0]
        print(
            f"base: solved {base_solved:.1%} of {args.runs} held-out runs, malformed calls "
            f"{base_malformed:.1%}; " + probabilities_line(base_probabilities),
            flush=True,
        )
        for seed in range(1, args.seeds + 1):
            print(f"\n=== seed {seed}/{args.seeds}: the first cycle's traffic ===", flush=True)
            samples = serve_first_cycle(engine, settings, stack.gateway_url, keys.ide, config, seed)
            agent = sum(s.tools_declared for s in samples)
            print(
                f"  batch: {len(samples)} samples ({agent} with tools declared), mean reward "
                f"{statistics.fmean(s.reward for s in samples):+.3f}",
                flush=True,
            )
            print(f"  {layouts_line(samples)}", flush=True)
            print(f"  {offsets_by_turn(samples)}", flush=True)
            train = config.train.model_copy(update={"seed": seed})
            for variant in variants:
                outcome, _ = train_and_judge(
                    settings, samples, train, variant, probe, args.runs, tokenizer
                )
                outcomes.append(outcome)
                print(
                    f"  {variant.name:<11} gain {100 * (outcome.solved - base_solved):+5.1f} pp, "
                    f"malformed {base_malformed:.1%} -> {outcome.malformed:.1%}; "
                    + probabilities_line(outcome.probabilities)
                    + f"; KL to production {outcome.kl_answers:.3f} answers, "
                    f"{outcome.kl_agent_turns:.3f} agent turns, {outcome.update_kl:.4f} update "
                    f"(update {outcome.update_seconds:.1f} s, {outcome.seconds:.0f} s in all)",
                    flush=True,
                )
    finally:
        engine.dispose()
        stack.down()

    print("\nper variant over seeds (gain in held-out solved runs over base):")
    for variant in variants:
        mine = [o for o in outcomes if o.variant == variant.name]
        gains = [100 * (o.solved - base_solved) for o in mine]
        spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
        malformed = statistics.fmean(o.malformed for o in mine)
        averaged = {
            label: statistics.fmean(o.probabilities[label] for o in mine)
            for label in base_probabilities
        }
        print(
            f"  {variant.name:<11} gain {statistics.fmean(gains):+5.1f} pp (std {spread:.1f}) "
            f"over seeds {', '.join(f'{g:+.1f}' for g in gains)}; malformed "
            f"{base_malformed:.1%} -> {malformed:.1%}; "
            + probabilities_line(averaged)
            + f"; update {statistics.fmean(o.update_seconds for o in mine):.1f} s"
        )
    print(f"wall time {(time.monotonic() - started) / 60:.1f} min")


def probabilities_line(probabilities: dict[str, float]) -> str:
    return ", ".join(f"p({label}) {value:.3f}" for label, value in probabilities.items())


if __name__ == "__main__":
    main()
