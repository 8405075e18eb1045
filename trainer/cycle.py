"""One training cycle: select, check drift, update, evaluate, publish as a canary."""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from sqlalchemy import Engine, select, update
from transformers import PreTrainedTokenizerFast

from app.config import Settings
from app.db import session_scope
from app.models import (
    Checkpoint,
    CheckpointStatus,
    CycleTrigger,
    TrainingRun,
    TrainingRunStatus,
)
from app.registry.audit import Actor
from app.registry.experiments import start_canary
from app.serving.checkpoints import publish_checkpoint, reconcile
from app.serving.parity import batch_logprobs, completion_batch, completion_logprobs, logprob_drift
from trainer.config import TrainConfig
from trainer.data import OnPolicyBatch, TrainingSample, select_on_policy_batch
from trainer.evaluate import HeldOut, gate, mean_kl, next_token_logprobs
from trainer.lock import trainer_lock
from trainer.loss import LossStats, advantages, policy_gradient_loss
from trainer.policy import load_trainable_policy, pick_device

log = logging.getLogger("rtrl.trainer")
TRAINER_ACTOR = Actor("trainer")
TRAINED = (TrainingRunStatus.published, TrainingRunStatus.rejected)
"""Runs that trained on their batch; skipped, refused and failed runs used none of it."""


@dataclass(frozen=True)
class CycleResult:
    run_id: int
    status: TrainingRunStatus
    reason: str | None
    checkpoint: str | None


def run_cycle(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    held_out: HeldOut,
    progress: Callable[[str], None] = log.info,
    on_published: Callable[[], None] | None = None,
    trigger: CycleTrigger = CycleTrigger.manual,
) -> CycleResult:
    """Run one cycle under the trainer lock and record it as a training run; `held_out` is
    what the evaluation gate scores the candidate on."""
    with trainer_lock(engine):
        return run_locked_cycle(
            settings,
            config,
            engine=engine,
            held_out=held_out,
            progress=progress,
            on_published=on_published,
            trigger=trigger,
        )


def run_locked_cycle(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    held_out: HeldOut,
    progress: Callable[[str], None] = log.info,
    on_published: Callable[[], None] | None = None,
    trigger: CycleTrigger = CycleTrigger.manual,
) -> CycleResult:
    """`run_cycle` for a caller that holds the trainer lock already."""
    if abandon_crashed_runs(engine):
        # A run that died while publishing may have left its adapter on a replica.
        report = reconcile(engine, settings.vllm_urls)
        for replica, names in report.unloaded.items():
            progress(f"unloaded unregistered {', '.join(names)} from {replica}")
        for error in report.errors:
            progress(f"reconcile: {error}")
    run_id, production, batch, previous = open_run(engine, config, trigger)
    progress(f"run {run_id}: {len(batch.samples)} on-policy samples of {production.name}")
    skip = skip_reason(batch, previous, config)
    if skip is not None:
        progress(f"run {run_id}: skipped: {skip}")
        return finish_run(engine, run_id, TrainingRunStatus.skipped, reason=skip)
    threads = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        return train_and_publish(
            settings,
            config,
            engine,
            run_id,
            production,
            batch,
            held_out,
            progress,
            on_published,
        )
    except Exception as exc:
        finish_run(engine, run_id, TrainingRunStatus.failed, reason=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        torch.set_num_threads(threads)


def abandon_crashed_runs(engine: Engine) -> int:
    """Runs still 'running' while we hold the lock died with their process; how many."""
    with session_scope(engine) as session:
        result = session.execute(
            update(TrainingRun)
            .where(TrainingRun.status == TrainingRunStatus.running)
            .values(
                status=TrainingRunStatus.failed,
                reason="the trainer process died during this run",
                finished_at=datetime.now(UTC),
            )
        )
    return int(getattr(result, "rowcount", 0) or 0)


def this_trainer() -> str:
    """This trainer process, as runs record it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def open_run(
    engine: Engine, config: TrainConfig, trigger: CycleTrigger
) -> tuple[int, Checkpoint, OnPolicyBatch, TrainingRun | None]:
    """Record a running run on the production checkpoint's batch; also returns the last run
    that trained from that checkpoint, if any."""
    with session_scope(engine) as session:
        production = session.scalar(
            select(Checkpoint).where(Checkpoint.status == CheckpointStatus.production)
        )
        if production is None:
            raise RuntimeError(
                "no production checkpoint; run `rtrl serve` once to register the base"
            )
        batch = select_on_policy_batch(session, production, max_samples=config.max_samples)
        previous = session.scalar(
            select(TrainingRun)
            .where(
                TrainingRun.base_checkpoint_id == production.id,
                TrainingRun.status.in_(TRAINED),
            )
            .order_by(TrainingRun.id.desc())
            .limit(1)
        )
        run = TrainingRun(
            status=TrainingRunStatus.running,
            config=config.as_dict(),
            base_checkpoint_id=production.id,
            sample_count=len(batch.samples),
            window_start=batch.window_start,
            window_end=batch.window_end,
            run_name=f"{production.name}-{datetime.now(UTC):%Y%m%dT%H%M%S}",
            trigger=trigger,
            trainer=this_trainer(),
        )
        session.add(run)
        session.flush()
        session.expunge(production)
        return run.id, production, batch, previous


def skip_reason(
    batch: OnPolicyBatch, previous: TrainingRun | None, config: TrainConfig
) -> str | None:
    """Why the cycle should not train: too few samples, or too few that the last run from the
    same production checkpoint has not trained on already."""
    count = len(batch.samples)
    if count < config.min_samples:
        return f"{count} finalized on-policy samples, fewer than {config.min_samples}"
    if previous is None or previous.window_end is None:
        return None
    new = batch.served_after(previous.window_end)
    if new >= config.min_new_samples:
        return None
    return (
        f"no new on-policy evidence: {new} finalized samples of {batch.checkpoint} served after "
        f"the window of run {previous.id} (to {previous.window_end.isoformat(timespec='seconds')})"
        f", fewer than {config.min_new_samples}"
    )


def finish_run(
    engine: Engine,
    run_id: int,
    status: TrainingRunStatus,
    *,
    reason: str | None = None,
    stats: dict[str, Any] | None = None,
    eval_results: dict[str, Any] | None = None,
    output_checkpoint_id: int | None = None,
) -> CycleResult:
    with session_scope(engine) as session:
        run = session.get_one(TrainingRun, run_id)
        run.status = status
        run.reason = reason
        run.stats = stats if stats is not None else run.stats
        run.eval_results = eval_results if eval_results is not None else run.eval_results
        run.output_checkpoint_id = output_checkpoint_id
        run.finished_at = datetime.now(UTC)
        name = None
        if output_checkpoint_id is not None:
            name = session.get_one(Checkpoint, output_checkpoint_id).name
    return CycleResult(run_id=run_id, status=status, reason=reason, checkpoint=name)


def train_and_publish(
    settings: Settings,
    config: TrainConfig,
    engine: Engine,
    run_id: int,
    production: Checkpoint,
    batch: OnPolicyBatch,
    held_out: HeldOut,
    progress: Callable[[str], None],
    on_published: Callable[[], None] | None,
) -> CycleResult:
    samples = batch.samples
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = pick_device(config)
    base_model = settings.base_model_path
    production_adapter = Path(production.adapter_path) if production.adapter_path else None
    policy = load_trainable_policy(base_model, production_adapter, config, device)

    probe = random.Random(config.seed).sample(samples, min(config.drift_probe_size, len(samples)))
    drift = logprob_drift(
        [s.behaviour_logprobs for s in probe],
        completion_logprobs(
            policy, [s.prompt_token_ids for s in probe], [s.completion_token_ids for s in probe]
        ),
    )
    drift_stats = {"drift_max_abs": drift.max_abs, "drift_mean_abs": drift.mean_abs}
    if not drift.within(config.drift_tolerance):
        reason = (
            f"serving/training drift: max |logged - recomputed| logprob {drift.max_abs:.2e} "
            f"exceeds {config.drift_tolerance:.0e} on {drift.tokens} probe tokens"
        )
        progress(f"run {run_id}: refused: {reason}")
        return finish_run(
            engine, run_id, TrainingRunStatus.refused, reason=reason, stats=drift_stats
        )

    tokenizer = PreTrainedTokenizerFast.from_pretrained(base_model)
    reference = held_out.reference(tokenizer)
    production_reference = next_token_logprobs(policy, reference)
    production_pass = held_out.pass_rate(policy, tokenizer)
    progress(f"run {run_id}: production held-out pass rate {production_pass:.3f}")

    stats = {**drift_stats, **update_policy(policy, samples, config, device, progress)}
    stats["reward_mean_before"] = sum(s.reward for s in samples) / len(samples)

    candidate_pass = held_out.pass_rate(policy, tokenizer)
    kl = mean_kl(
        next_token_logprobs(policy, reference), production_reference, reference.completion_mask
    )
    result = gate(
        production_pass,
        candidate_pass,
        kl,
        max_regression=config.eval_max_regression,
        max_kl=config.eval_max_kl,
    )
    progress(f"run {run_id}: candidate held-out pass rate {candidate_pass:.3f}, KL {kl:.4f}")
    if not result.passed:
        progress(f"run {run_id}: rejected: {result.reason}")
        return finish_run(
            engine,
            run_id,
            TrainingRunStatus.rejected,
            reason=result.reason,
            stats=stats,
            eval_results=result.as_dict(),
        )

    adapter_dir = settings.data_dir.resolve() / "runs" / f"run-{run_id}" / "adapter"
    policy.save_pretrained(str(adapter_dir))
    checkpoint = publish_checkpoint(
        engine,
        adapter_dir,
        parent=production.name,
        replicas=settings.vllm_urls,
        checkpoints_dir=settings.checkpoints_dir.resolve(),
        base_model=str(base_model),
        reward_version=settings.reward_version,
        manifest={
            "training_run": run_id,
            "data_window": [batch.window_start, batch.window_end],
            "samples": len(samples),
        },
    )
    with session_scope(engine) as session:
        control = session.get_one(Checkpoint, production.id)
        treatment = session.get_one(Checkpoint, checkpoint.id)
        start_canary(
            session,
            control=control,
            treatment=treatment,
            treatment_bps=config.canary_bps,
            created_by=f"trainer run {run_id}",
            actor=TRAINER_ACTOR,
        )
        superseded = ", ".join(
            session.scalars(
                select(Checkpoint.name).where(Checkpoint.superseded_by_id == treatment.id)
            )
        )
    if on_published is not None:
        on_published()
    progress(f"run {run_id}: published {checkpoint.name} as a {config.canary_bps / 100:g}% canary")
    if superseded:
        progress(f"run {run_id}: the canary {superseded} is superseded by {checkpoint.name}")
    return finish_run(
        engine,
        run_id,
        TrainingRunStatus.published,
        reason=f"superseded the canary {superseded}" if superseded else None,
        stats=stats,
        eval_results=result.as_dict(),
        output_checkpoint_id=checkpoint.id,
    )


def right_aligned(rows: list[list[float]], width: int) -> torch.Tensor:
    """Per-token values placed at the end of a [len(rows), width] tensor, as batches are."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        if row:
            out[i, width - len(row) :] = torch.tensor(row)
    return out


def update_policy(
    policy: torch.nn.Module,
    samples: list[TrainingSample],
    config: TrainConfig,
    device: torch.device,
    progress: Callable[[str], None],
) -> dict[str, float]:
    """Epochs of clipped policy-gradient steps over the batch; returns the run's statistics."""
    prompts = [s.prompt_token_ids for s in samples]
    completions = [s.completion_token_ids for s in samples]
    old_logprobs = completion_logprobs(policy, prompts, completions)
    base_logprobs = None
    if config.kl_coef > 0:
        with policy.disable_adapter():  # type: ignore[operator]
            base_logprobs = completion_logprobs(policy, prompts, completions)
    advantage = advantages([s.reward for s in samples], [tuple(p) for p in prompts])

    optimizer = torch.optim.AdamW(
        [p for p in policy.parameters() if p.requires_grad], lr=config.learning_rate
    )
    generator = torch.Generator().manual_seed(config.seed)
    history: list[LossStats] = []
    tokens_seen, started = 0, time.perf_counter()
    policy.train()
    steps = 0
    for epoch in range(config.epochs):
        epoch_start = len(history)
        order = torch.randperm(len(samples), generator=generator).tolist()
        for start in range(0, len(order), config.minibatch_size):
            minibatch = order[start : start + config.minibatch_size]
            minibatch_tokens = sum(len(completions[i]) for i in minibatch)
            optimizer.zero_grad()
            for micro_start in range(0, len(minibatch), config.micro_batch_size):
                micro = minibatch[micro_start : micro_start + config.micro_batch_size]
                batch = completion_batch(
                    [prompts[i] for i in micro], [completions[i] for i in micro]
                )
                width = batch.width
                loss, stats = policy_gradient_loss(
                    batch_logprobs(policy, batch.to(device)),
                    right_aligned([old_logprobs[i] for i in micro], width).to(device),
                    right_aligned([samples[i].behaviour_logprobs for i in micro], width).to(device),
                    advantage[micro].to(device),
                    batch.completion_mask.to(device),
                    clip_epsilon=config.clip_epsilon,
                    tis_cap=config.tis_cap,
                    base_logprobs=(
                        right_aligned([base_logprobs[i] for i in micro], width).to(device)
                        if base_logprobs is not None
                        else None
                    ),
                    kl_coef=config.kl_coef,
                )
                micro_tokens = int(batch.completion_mask.sum())
                # Token-level mean over the whole minibatch, however it is split.
                (loss * micro_tokens / max(minibatch_tokens, 1)).backward()
                history.append(stats)
                tokens_seen += micro_tokens
            torch.nn.utils.clip_grad_norm_(policy.parameters(), config.max_grad_norm)
            optimizer.step()
            steps += 1
        epoch_stats = history[epoch_start:] or history
        epoch_loss = sum(h.loss for h in epoch_stats) / len(epoch_stats)
        clip = sum(h.clip_fraction for h in epoch_stats) / len(epoch_stats)
        progress(
            f"epoch {epoch + 1}/{config.epochs}: loss {epoch_loss:+.4f}, clip fraction {clip:.3f}"
        )
    elapsed = time.perf_counter() - started
    policy.eval()
    n = max(len(history), 1)
    return {
        "loss": sum(h.loss for h in history) / n,
        "mean_ratio": sum(h.mean_ratio for h in history) / n,
        "clip_fraction": sum(h.clip_fraction for h in history) / n,
        "mean_tis_weight": sum(h.mean_tis_weight for h in history) / n,
        "kl_to_base": sum(h.kl_to_base for h in history) / n,
        "optimizer_steps": steps,
        "tokens": tokens_seen,
        "tokens_per_s": tokens_seen / elapsed if elapsed > 0 else 0.0,
        "update_seconds": elapsed,
    }
