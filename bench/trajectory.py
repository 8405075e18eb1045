"""Training an agent run: each turn as its own sample (step-wise) vs the turns merged into one
sequence with a loss mask, when each turn's prompt starts with the previous turn's tokens.

First a synthetic 8-turn run of the bootstrapped model's shape: turn t's prompt is turn t-1's
prompt and completion followed by a tool result, so step-wise training feeds the history again
on every turn (O(T^2) tokens) while the merged sequence feeds it once (O(T)); the loss covers
only the model's own tokens in both. Both sides run the same forward and backward on the same
policy (logprobs of every completion token, summed), from the same clock start, and the bench
checks that they compute the same logprobs before timing them.

Then, with `--demo-users N`, the demo's own traffic: N developers' agent runs of the demo's
first cycle served on the base through the real stack (vLLM, gateway, Kafka, a worker), their
rewards finalized (as `bench.baseline` serves them), the stack stopped, and the on-policy batch
trained by the trainer's own code with the demo's settings in both layouts, alternating
(step-wise, merged, step-wise, ...) `--demo-rounds` times: the drift check's recomputation of
every served token's logprob, and the update (`update_policy`): tokens fed, trained tokens/s,
wall time; and how far apart the two layouts' logprobs and drift figures are.

    python -m bench.trajectory [--turns 8] [--completion 48] [--tool-result 64] [--rounds 5]
        [--demo-users 24] [--demo-rounds 2] [--seed 1]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.utils import logging as transformers_logging

from app.db import make_engine
from bench._stack import scratch_settings
from bench.baseline import serve_first_cycle
from bench.serving import load_average
from rtrl.demo import DemoConfig, Ops, create_keys, demo_train_config
from rtrl.launcher import FullStack
from sandbox.bootstrap import BootstrapConfig, bootstrap_model
from trainer.config import Layout, TrainConfig
from trainer.data import TrainingSample
from trainer.drift import measure_drift
from trainer.policy import load_trainable_policy
from trainer.sequences import layout_rows, row_batch, row_logprobs
from trainer.update import sharded_logprobs, update_policy


def make_run(
    turns: int, first_prompt: int, completion: int, tool_result: int, vocab: int, seed: int
) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) token ids per turn; each prompt extends the previous turn."""
    rng = random.Random(seed)
    prompt = [rng.randrange(3, vocab) for _ in range(first_prompt)]
    run = []
    for _ in range(turns):
        answer = [rng.randrange(3, vocab) for _ in range(completion)]
        run.append((prompt, answer))
        prompt = [*prompt, *answer, *(rng.randrange(3, vocab) for _ in range(tool_result))]
    return run


SERVED = datetime(2026, 1, 1, tzinfo=UTC)


def run_samples(run: list[tuple[list[int], list[int]]]) -> list[TrainingSample]:
    """The run's turns as the trainer's samples."""
    return [
        TrainingSample(
            sample_id=turn,
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            behaviour_logprobs=[0.0] * len(completion),
            reward=0.0,
            served_at=SERVED,
            tools_declared=True,
            turn_index=turn,
            trajectory_id="run",
        )
        for turn, (prompt, completion) in enumerate(run)
    ]


def layout_logprobs(
    model: torch.nn.Module, samples: list[TrainingSample], layout: Layout
) -> torch.Tensor:
    """Every completion token's logprob as the trainer computes it on `layout`'s rows:
    step-wise each turn a row (left-padded as the trainer batches them), merged one row whose
    loss mask keeps only the completions."""
    batch = row_batch(layout_rows(samples, layout).rows, samples)
    return row_logprobs(model, batch)[batch.trained]


def timed(
    model: torch.nn.Module, samples: list[TrainingSample], layout: Layout, rounds: int
) -> float:
    """Seconds per forward + backward of the summed completion logprobs."""
    started = time.perf_counter()
    for _ in range(rounds):
        model.zero_grad()
        layout_logprobs(model, samples, layout).sum().backward()
    return (time.perf_counter() - started) / rounds


def demo_batch(
    users: int, seed: int, data_dir: Path
) -> tuple[list[TrainingSample], Path, TrainConfig]:
    """The demo's first agent cycle's on-policy batch on the base (`users` developers, traffic
    `seed`), served through the whole stack, which is stopped before this returns; the base
    model's directory and the demo's training settings."""
    settings = scratch_settings(data_dir)
    config = DemoConfig(
        cycles=1, train_users=users, progress_bars=False, train=demo_train_config(agent=True)
    )
    print(f"demo traffic: data in {data_dir}; starting the stack ...", flush=True)
    stack = FullStack.from_settings(settings, workers=1, trainer=False, progress=print)
    stack.up()
    engine = make_engine(settings.database_url)
    try:
        keys = create_keys(engine)
        Ops(stack.gateway_url, keys.ops).stop_all()
        samples = serve_first_cycle(engine, settings, stack.gateway_url, keys.ide, config, seed)
    finally:
        engine.dispose()
        stack.down()
    return samples, settings.base_model_path, config.train.model_copy(update={"seed": seed})


@dataclass
class LayoutRound:
    layout: Layout
    drift_s: float
    """Every served token's logprob recomputed (the drift check, PPO's old logprobs)."""
    update_s: float
    tokens_fed: float
    trained_tokens: float
    loss: float
    logprobs: list[list[float]]

    @property
    def trained_per_s(self) -> float:
        return self.trained_tokens / self.update_s


def train_in(
    model_dir: Path, samples: list[TrainingSample], config: TrainConfig, layout: Layout
) -> LayoutRound:
    """A fresh LoRA on the base: the cycle's drift recomputation and update in `layout`."""
    config = config.model_copy(update={"layout": layout})
    torch.manual_seed(config.seed)
    device = torch.device("cpu")
    policy = load_trainable_policy(model_dir, None, config, device)
    started = time.perf_counter()
    old = sharded_logprobs(policy, samples, config)
    drift_s = time.perf_counter() - started
    stats = update_policy(policy, samples, old, config, device, lambda line: None)
    return LayoutRound(
        layout,
        drift_s,
        float(stats["update_seconds"]),
        float(stats["tokens_fed"]),
        float(stats["tokens"]),
        float(stats["loss"]),
        old,
    )


def demo_layouts(users: int, seed: int, rounds: int) -> None:
    data_dir = Path(tempfile.mkdtemp(prefix="rtrl-trajectory-"))
    try:
        samples, model_dir, config = demo_batch(users, seed, data_dir)
        compare_layouts(samples, model_dir, config, rounds, users)
    finally:
        shutil.rmtree(data_dir)


def compare_layouts(
    samples: list[TrainingSample], model_dir: Path, config: TrainConfig, rounds: int, users: int
) -> None:
    """Train the batch in both layouts, alternating, `rounds` times each; print the figures."""
    torch.set_num_threads(config.threads or torch.get_num_threads())
    runs = Counter(s.trajectory_id for s in samples if s.trajectory_id is not None)
    lengths = Counter(runs.values())
    merged, stepwise = layout_rows(samples, "merged"), layout_rows(samples, "stepwise")
    print(
        f"\nthe demo's first agent cycle ({users} developers, seed {config.seed}): "
        f"{len(samples)} samples in {len(runs)} runs (turns: "
        + ", ".join(f"{n} x{count}" for n, count in sorted(lengths.items()))
        + f"), {sum(s.trajectory_id is None for s in samples)} alone"
    )
    print(
        f"rows per pass: step-wise {len(stepwise.rows)} rows, {stepwise.tokens_fed} tokens; "
        f"merged {len(merged.rows)} rows, {merged.tokens_fed} tokens "
        f"({stepwise.tokens_fed / merged.tokens_fed:.2f}x fewer); {merged.breaks} breaks "
        f"(a turn whose prompt did not extend its run's last turn)"
    )
    print(
        f"training: the demo's settings (epochs {config.epochs}, minibatch {config.minibatch_size}"
        f" samples, {config.micro_batch_tokens}-token micro-batches, {torch.get_num_threads()} "
        f"threads), a fresh LoRA each time; {load_average()}",
        flush=True,
    )
    done: list[LayoutRound] = []
    for number in range(rounds):
        for layout in ("stepwise", "merged"):
            result = train_in(model_dir, samples, config, layout)
            done.append(result)
            print(
                f"  round {number + 1} {layout:<9} drift recomputation {result.drift_s:6.2f} s, "
                f"update {result.update_s:6.2f} s: {result.tokens_fed:7.0f} tokens fed, "
                f"{result.trained_per_s:6.0f} trained tokens/s, loss {result.loss:+.4f}",
                flush=True,
            )
    by_layout = {
        layout: [r for r in done if r.layout == layout] for layout in ("stepwise", "merged")
    }
    first = {layout: results[0] for layout, results in by_layout.items()}
    apart = max(
        (
            abs(a - b)
            for ours, theirs in zip(
                first["merged"].logprobs, first["stepwise"].logprobs, strict=True
            )
            for a, b in zip(ours, theirs, strict=True)
        ),
        default=0.0,
    )
    logged = [s.behaviour_logprobs for s in samples]
    drift = {
        layout: measure_drift(logged, r.logprobs, tis_cap=config.tis_cap)
        for layout, r in first.items()
    }
    print(
        f"same logprobs: max |step-wise - merged| {apart:.2e} over "
        f"{drift['merged'].tokens} tokens; drift against vLLM's: mean |Δ| "
        f"{drift['stepwise'].mean_abs:.2e} step-wise, {drift['merged'].mean_abs:.2e} merged, "
        f"max {drift['stepwise'].max_abs:.2e} / {drift['merged'].max_abs:.2e}"
    )
    mean = {
        layout: (
            statistics.fmean(r.drift_s for r in results),
            statistics.fmean(r.update_s for r in results),
            statistics.fmean(r.trained_per_s for r in results),
        )
        for layout, results in by_layout.items()
    }
    for layout, (drift_s, update_s, per_s) in mean.items():
        print(
            f"{layout:<9} mean of {rounds}: drift recomputation {drift_s:6.2f} s, update "
            f"{update_s:6.2f} s, {per_s:6.0f} trained tokens/s; step {drift_s + update_s:6.2f} s"
        )
    before, after = sum(mean["stepwise"][:2]), sum(mean["merged"][:2])
    print(
        f"merged: the training step (drift recomputation + update) {before:.2f} s -> "
        f"{after:.2f} s, {before / after:.2f}x faster"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--first-prompt", type=int, default=80)
    parser.add_argument("--completion", type=int, default=48)
    parser.add_argument("--tool-result", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", type=Path, help="a bootstrapped model (default: build one)")
    parser.add_argument(
        "--demo-users",
        type=int,
        default=0,
        help="also train the demo's first agent cycle's batch of this many developers in "
        "both layouts (0: the synthetic run only)",
    )
    parser.add_argument("--demo-rounds", type=int, default=2, help="alternations of layouts")
    parser.add_argument("--seed", type=int, default=1, help="the demo traffic's seed")
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    print(load_average())
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as scratch:
        model_dir = args.model or Path(scratch) / "base"
        if args.model is None:
            bootstrap_model(model_dir, BootstrapConfig.small())
        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        run = make_run(
            args.turns,
            args.first_prompt,
            args.completion,
            args.tool_result,
            model.config.vocab_size,
            seed=1,
        )
        longest = len(run[-1][0]) + len(run[-1][1])
        if longest > model.config.max_position_embeddings:
            raise SystemExit(f"the run is {longest} tokens, longer than the model's context")
        samples = run_samples(run)
        with torch.no_grad():
            difference = (
                (
                    layout_logprobs(model, samples, "stepwise")
                    - layout_logprobs(model, samples, "merged")
                )
                .abs()
                .max()
            )
        stepwise_tokens = sum(len(p) + len(c) for p, c in run)
        merged_tokens = longest
        trained = sum(len(c) for _, c in run)
        stepwise_s = timed(model, samples, "stepwise", args.rounds)
        merged_s = timed(model, samples, "merged", args.rounds)
    print(
        f"{args.turns}-turn run: {trained} trained tokens; step-wise feeds {stepwise_tokens} "
        f"tokens, merged {merged_tokens} ({stepwise_tokens / merged_tokens:.1f}x fewer)"
    )
    print(f"same logprobs: max |step-wise - merged| = {difference:.2e}")
    print(
        f"step-wise {trained / stepwise_s:8.0f} trained tokens/s  ({stepwise_s * 1000:.0f} ms "
        f"per forward+backward)"
    )
    print(
        f"merged    {trained / merged_s:8.0f} trained tokens/s  ({merged_s * 1000:.0f} ms "
        f"per forward+backward), {stepwise_s / merged_s:.1f}x step-wise"
    )
    if args.demo_users > 0:
        demo_layouts(args.demo_users, args.seed, args.demo_rounds)
    print(load_average())


if __name__ == "__main__":
    main()
