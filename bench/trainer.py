"""Trainer: the update step's tokens/s and a whole cycle's wall time, beside a raw training loop.

Starts its own embedded Postgres and a vLLM server on the base model (`--model`, or one
bootstrapped into a temp dir first), samples `--samples` completions of training tasks
from the base through vLLM, and records them as on-policy samples rewarded 1 when the
answer solves its task, else 0. Then, in one run:
  cycle   `run_cycle` with TrainConfig defaults: drift probe, held-out eval, update, eval,
          save, publish into vLLM, canary; its timeline from the progress messages, and
          `update_policy`'s tokens/s (the run's stats["tokens_per_s"]);
  raw     the same model and LoRA on the same micro-batches (same sequences, same size,
          same order): forward, cross-entropy on the completion tokens, backward,
          optimizer step after each micro-batch, nothing else; batches built before the
          clock starts. Measured before and after the cycle, as the machine's load drifts.

    python -m bench.trainer [--model DIR] [--samples 256] [--threads N]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import torch
import torch.nn.functional as F
from sqlalchemy import Engine, select
from transformers import PreTrainedTokenizerFast
from transformers.utils import logging as transformers_logging

from app.config import Settings
from app.db import session_scope
from app.models import Checkpoint, Reward, Sample, TrainingRun
from app.processes import free_port
from app.serving.parity import CompletionBatch, completion_batch
from app.serving.publish import BASE_CHECKPOINT
from app.serving.sampling import sample_completions
from app.serving.vllm import VllmServer
from bench._stack import registry_with_base, scratch_stack
from bench.serving import base_model, load_average
from sandbox.task_family import task_family_held_out
from sandbox.tasks import check_solution, extract_code, train_tasks
from trainer.config import TrainConfig
from trainer.cycle import run_cycle
from trainer.data import TrainingSample, select_on_policy_batch
from trainer.generation import prompt_ids
from trainer.policy import load_trainable_policy, pick_device
from trainer.update import micro_batches as pack


def record_samples(engine: Engine, server: VllmServer, model_dir: Path, count: int) -> float:
    """Sample `count` training tasks from the base through vLLM and store them with
    finalized rewards (1 if the answer solves its task); returns the share solved."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    tasks = train_tasks(seed=7, n=count)
    prompts = [prompt_ids(tokenizer, task.request) for task in tasks]
    completions = sample_completions(server.url, BASE_CHECKPOINT, prompts, max_tokens=48)
    now = datetime.now(UTC)
    solved = 0
    with session_scope(engine) as session:
        for index, (task, completion) in enumerate(zip(tasks, completions, strict=True)):
            code = extract_code(completion.text)
            reward = float(check_solution(task, code or ""))
            solved += int(reward)
            sample = Sample(
                event_id=uuid.uuid4(),
                request_id=f"bench-{uuid.uuid4().hex}",
                session_id="bench-trainer",
                user_hash="bench",
                checkpoint=BASE_CHECKPOINT,
                privacy=False,
                trainable=True,
                edit_requested=True,
                proposed_edit=code is not None,
                prompt_token_ids=completion.prompt_token_ids,
                completion_token_ids=completion.completion_token_ids,
                behaviour_logprobs=completion.logprobs,
                completion_text=completion.text,
                finish_reason=completion.finish_reason,
                status="ok",
                ttft_ms=1.0,
                latency_ms=1.0,
                # Distinct times give the cycle's newest-first selection one order.
                served_at=now - timedelta(milliseconds=index),
            )
            session.add(sample)
            session.flush()
            session.add(
                Reward(
                    sample_id=sample.id,
                    components={"task": task.task_id},
                    reward=reward,
                    reward_version=1,
                    due_at=now,
                    finalized_at=now,
                    finalize_reason="horizon",
                )
            )
    return solved / count


def on_policy_samples(engine: Engine) -> list[TrainingSample]:
    """The samples the cycle will train on, in the order it selects them."""
    with session_scope(engine) as session:
        base = session.scalar(select(Checkpoint).where(Checkpoint.name == BASE_CHECKPOINT))
        assert base is not None
        return select_on_policy_batch(session, base, max_samples=TrainConfig().max_samples).samples


def micro_batches(samples: list[TrainingSample], config: TrainConfig) -> list[CompletionBatch]:
    """The micro-batches `update_policy` forms on one rank, epoch by epoch, from the same
    generator."""
    generator = torch.Generator().manual_seed(config.seed)
    lengths = [len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples]
    batches = []
    for _ in range(config.epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), config.minibatch_size):
            minibatch = order[start : start + config.minibatch_size]
            for group in pack(minibatch, lengths, config.micro_batch_tokens):
                micro = [samples[i] for i in group]
                batches.append(
                    completion_batch(
                        [s.prompt_token_ids for s in micro], [s.completion_token_ids for s in micro]
                    )
                )
    return batches


def raw_tokens_per_s(model_dir: Path, batches: list[CompletionBatch], config: TrainConfig) -> float:
    """Forward, cross-entropy on completion tokens, backward, step: completion tokens/s."""
    device = pick_device(config)
    policy = load_trainable_policy(model_dir, None, config, device)
    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate
    )
    batches = [batch.to(device) for batch in batches]
    policy.train()

    def step(batch: CompletionBatch) -> int:
        logits = policy(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            logits_to_keep=batch.width + 1,
        ).logits[:, :-1]
        mask = batch.completion_mask
        loss = F.cross_entropy(logits[mask].float(), batch.targets[mask])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return int(mask.sum())

    step(batches[0])  # warm-up: first-call allocations are not what the loop costs
    started = time.perf_counter()
    tokens = sum(step(batch) for batch in batches)
    return tokens / (time.perf_counter() - started)


@dataclass
class Timeline:
    """`run_cycle`'s progress messages with the time each arrived."""

    started: float = field(default_factory=time.perf_counter)
    events: list[tuple[float, str]] = field(default_factory=list)

    def progress(self, message: str) -> None:
        self.events.append((time.perf_counter() - self.started, message))

    def at(self, prefix: str) -> float | None:
        """When the last message containing `prefix` arrived."""
        times = [at for at, message in self.events if prefix in message]
        return times[-1] if times else None

    def print(self) -> None:
        print("  since start     Δ  message (Δ: the work done before it)")
        previous = 0.0
        for at, message in self.events:
            print(f"  {at:9.1f} s {at - previous:6.1f}  {message}")
            previous = at


def bench(args: argparse.Namespace, scratch: Path) -> None:
    model_dir = base_model(args.model)
    config = TrainConfig()
    changed = {}
    if args.samples < config.min_samples:
        changed["min_samples"] = args.samples
    config = config.model_copy(update=changed)
    print(
        f"model {model_dir}; TrainConfig defaults, changed: {changed or 'nothing'}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {pick_device(config)}"
    )

    stack = scratch_stack(scratch)
    server = VllmServer(model_dir=model_dir, port=free_port(), root=scratch / "vllm")
    engine = None
    try:
        engine = registry_with_base(stack, model_dir)
        started = time.perf_counter()
        server.start(timeout=600)
        print(f"vLLM start {time.perf_counter() - started:.1f} s")

        started = time.perf_counter()
        solved = record_samples(engine, server, model_dir, args.samples)
        print(
            f"{args.samples} samples from the base through vLLM in "
            f"{time.perf_counter() - started:.1f} s; {solved:.1%} solve their task (reward 1)"
        )
        batches = micro_batches(on_policy_samples(engine), config)
        raw_before = raw_tokens_per_s(model_dir, batches, config)

        settings = Settings(
            data_dir=scratch,
            database_url=stack.postgres.url,
            vllm_urls=[server.url],
            base_model=model_dir,
        )
        timeline = Timeline()
        result = run_cycle(
            settings,
            config,
            engine=engine,
            held_out=task_family_held_out(config),
            progress=timeline.progress,
        )
        timeline.progress(f"run_cycle returned: {result.status} {result.reason or ''}")
        raw_after = raw_tokens_per_s(model_dir, batches, config)

        with session_scope(engine) as session:
            run = session.get_one(TrainingRun, result.run_id)
            stats, eval_results = run.stats or {}, run.eval_results or {}
        report(timeline, stats, eval_results, raw_before, raw_after)
    finally:
        if engine is not None:
            engine.dispose()
        server.stop()
        stack.postgres.stop()


def report(
    timeline: Timeline,
    stats: dict[str, float],
    eval_results: dict[str, float],
    raw_before: float,
    raw_after: float,
) -> None:
    print(f"run_cycle {timeline.events[-1][0]:.1f} s wall:")
    timeline.print()
    selected, drift = timeline.at("on-policy samples"), timeline.at("drift over")
    if stats and selected is not None and drift is not None:
        loop = stats["update_seconds"]
        print(
            f"  policy load + every sampled token's logprob recomputed (drift check, PPO's "
            f"old logprobs) {drift - selected:.1f} s; optimizer loop {loop:.1f} s"
        )
    if stats:
        update = stats["tokens_per_s"]
        raw = (raw_before + raw_after) / 2
        print(
            f"update  {update:7.0f} tokens/s  ({stats['tokens']:.0f} completion tokens, "
            f"{stats['optimizer_steps']:.0f} optimizer steps)"
        )
        print(
            f"raw     {raw:7.0f} tokens/s  "
            f"(mean of {raw_before:.0f} before the cycle and {raw_after:.0f} after)"
        )
        print(f"ratio   {update / raw:.2f} update/raw")
    if eval_results:
        print(
            f"held-out pass rate {eval_results['production_pass_rate']:.3f} before, "
            f"{eval_results['candidate_pass_rate']:.3f} after "
            f"(KL to production {eval_results['kl_to_production']:.4f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="base model dir (default: bootstrap one)")
    parser.add_argument("--samples", type=int, default=256, help="on-policy samples to record")
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch CPU threads for the cycle and the raw loop alike (default: torch's, as "
        "the trainer runs); 1 is steadier on a machine other busy processes share",
    )
    args = parser.parse_args()
    transformers_logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(load_average())
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-") as scratch:
        bench(args, Path(scratch))
    print(load_average())


if __name__ == "__main__":
    main()
