"""One training cycle: select, check drift, update, evaluate, publish as a canary.

Under `torchrun` every rank calls `run_cycle`: rank 0 takes the trainer lock, selects the
batch and shares it; every rank measures drift and trains on its share; rank 0 evaluates,
saves and publishes, and shares the outcome (`trainer.distributed`).
"""

from __future__ import annotations

import logging
import os
import random
import socket
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
from app.registry.audit import Actor, audit
from app.registry.experiments import start_canary
from app.serving.publish import publish_checkpoint, reconcile
from trainer.config import TrainConfig
from trainer.data import (
    OnPolicyBatch,
    TrainingSample,
    erased_since_selected,
    select_on_policy_batch,
)
from trainer.distributed import SINGLE, World, share
from trainer.drift import drift_limits, measure_drift
from trainer.evaluate import (
    HeldOut,
    HeldOutUnavailable,
    Reference,
    gate,
    kl_to_production,
    trainable_state,
)
from trainer.lock import trainer_lock
from trainer.metrics import record_merge_breaks, record_run
from trainer.policy import load_trainable_policy, pick_device, policy_dtype
from trainer.prediction import LoggedSlice, hold_reason, prediction_summary
from trainer.sequences import layout_rows
from trainer.update import sharded_logprobs, update_policy

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


@dataclass(frozen=True)
class CyclePlan:
    """What rank 0 decided to train on, shared with every rank."""

    run_id: int
    production_id: int
    production_name: str
    production_adapter: str | None
    samples: list[TrainingSample]
    window: tuple[datetime | None, datetime | None]


def run_cycle(
    settings: Settings,
    config: TrainConfig,
    *,
    engine: Engine,
    held_out: HeldOut,
    progress: Callable[[str], None] = log.info,
    on_published: Callable[[], None] | None = None,
    trigger: CycleTrigger = CycleTrigger.manual,
    world: World = SINGLE,
) -> CycleResult:
    """Run one cycle under the trainer lock and record it as a training run; `held_out` is
    what the evaluation gate scores the candidate on. On a rank other than 0: train with
    rank 0, and return its outcome."""
    if not world.is_main:
        return follow_cycle(settings, config, world)
    with trainer_lock(engine):
        return run_locked_cycle(
            settings,
            config,
            engine=engine,
            held_out=held_out,
            progress=progress,
            on_published=on_published,
            trigger=trigger,
            world=world,
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
    world: World = SINGLE,
) -> CycleResult:
    """`run_cycle` for a caller that holds the trainer lock already (rank 0)."""
    try:
        if abandon_crashed_runs(engine):
            # A run that died while publishing may have left its adapter on a replica.
            report = reconcile(
                engine, settings.vllm_urls, api_key=settings.vllm_api_key.get_secret_value()
            )
            for replica, names in report.unloaded.items():
                progress(f"unloaded unregistered {', '.join(names)} from {replica}")
            for error in report.errors:
                progress(f"reconcile: {error}")
        run_id, production, batch, previous = open_run(
            engine, config, trigger, max(held_out.withheld_percent, config.prediction_percent)
        )
        progress(f"run {run_id}: {len(batch.samples)} on-policy samples of {production.name}")
        skip = skip_reason(batch, previous, config)
        reference = None
        if skip is None:
            tokenizer = PreTrainedTokenizerFast.from_pretrained(settings.base_model_path)
            try:
                reference = held_out.reference(tokenizer)
            except HeldOutUnavailable as exc:
                skip = str(exc)
        if skip is not None or reference is None:
            progress(f"run {run_id}: skipped: {skip}")
            skipped = finish_run(engine, run_id, TrainingRunStatus.skipped, reason=skip)
            return share(skipped, world)
    except BaseException:
        nothing: CyclePlan | CycleResult | None = None
        share(nothing, world)  # the other ranks stop waiting
        raise
    plan = CyclePlan(
        run_id=run_id,
        production_id=production.id,
        production_name=production.name,
        production_adapter=production.adapter_path,
        samples=batch.samples,
        window=(batch.window_start, batch.window_end),
    )
    share(plan, world)
    threads = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        return train_and_publish(
            settings,
            config,
            plan,
            engine=engine,
            held_out=held_out,
            reference=reference,
            progress=progress,
            on_published=on_published,
            world=world,
        )
    except Exception as exc:
        finish_run(engine, run_id, TrainingRunStatus.failed, reason=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        torch.set_num_threads(threads)


def follow_cycle(settings: Settings, config: TrainConfig, world: World) -> CycleResult:
    """A rank other than 0: wait for rank 0's plan, train with it, return its outcome."""
    plan: CyclePlan | CycleResult | None = None
    plan = share(plan, world)
    if plan is None:
        raise RuntimeError("rank 0 failed before it shared its plan; see its log")
    if isinstance(plan, CycleResult):
        return plan  # nothing to train
    threads = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        return train_and_publish(settings, config, plan, world=world)
    finally:
        torch.set_num_threads(threads)


def abandon_crashed_runs(engine: Engine) -> int:
    """Runs still 'running' while we hold the lock died with their process; how many."""
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        result = session.execute(
            update(TrainingRun)
            .where(TrainingRun.status == TrainingRunStatus.running)
            .values(
                status=TrainingRunStatus.failed,
                reason="the trainer process died during this run",
                finished_at=now,
            )
        )
    abandoned = int(getattr(result, "rowcount", 0) or 0)
    if abandoned:
        record_run(TrainingRunStatus.failed, now, abandoned)
    return abandoned


def this_trainer() -> str:
    """This trainer process, as runs record it."""
    return f"{socket.gethostname()}:{os.getpid()}"


def open_run(
    engine: Engine, config: TrainConfig, trigger: CycleTrigger, withheld_percent: int = 0
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
        batch = select_on_policy_batch(
            session, production, max_samples=config.max_samples, withheld_percent=withheld_percent
        )
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
    prediction: dict[str, Any] | None = None,
    output_checkpoint_id: int | None = None,
) -> CycleResult:
    with session_scope(engine) as session:
        run = session.get_one(TrainingRun, run_id)
        run.status = status
        run.reason = reason
        run.stats = stats if stats is not None else run.stats
        run.eval_results = eval_results if eval_results is not None else run.eval_results
        run.prediction = prediction if prediction is not None else run.prediction
        run.output_checkpoint_id = output_checkpoint_id
        run.finished_at = datetime.now(UTC)
        name = None
        if output_checkpoint_id is not None:
            name = session.get_one(Checkpoint, output_checkpoint_id).name
    record_run(status, datetime.now(UTC))
    return CycleResult(run_id=run_id, status=status, reason=reason, checkpoint=name)


def train_and_publish(
    settings: Settings,
    config: TrainConfig,
    plan: CyclePlan,
    *,
    engine: Engine | None = None,
    held_out: HeldOut | None = None,
    reference: Reference | None = None,
    progress: Callable[[str], None] = log.debug,
    on_published: Callable[[], None] | None = None,
    world: World = SINGLE,
) -> CycleResult:
    """Every rank: drift check and update. Rank 0 (which alone gets `engine`, `held_out` and
    its `reference`): evaluation gate, save, publish, canary, and the run's record."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = pick_device(config, world)
    dtype = policy_dtype(config, device)
    base_model = settings.base_model_path
    production_adapter = Path(plan.production_adapter) if plan.production_adapter else None
    policy = load_trainable_policy(base_model, production_adapter, config, device)
    samples = plan.samples

    # A run's turns as one sequence where each extends the last (or each turn alone).
    layout = layout_rows(samples, config.layout)
    if world.is_main:
        record_merge_breaks(layout.breaks)
    progress(
        f"run {plan.run_id}: {len(samples)} samples as {len(layout.rows)} {config.layout} rows "
        f"of {layout.tokens_fed} tokens; {layout.breaks} breaks where a turn's prompt did not "
        f"extend its run's last turn"
    )
    # Serving/training drift: our logprobs of every token vLLM sampled, against its own.
    # They are also the pre-update policy's logprobs that the PPO ratio divides by.
    old_logprobs = sharded_logprobs(policy, samples, config, world, layout)
    drift = measure_drift(
        [s.behaviour_logprobs for s in samples], old_logprobs, tis_cap=config.tis_cap
    )
    limits = drift_limits(
        dtype,
        max_abs=config.drift_max_abs,
        mean_abs=config.drift_mean_abs,
        kl=config.drift_kl,
        capped_share=config.drift_capped_share,
    )
    stats: dict[str, Any] = {
        **drift.as_stats(),
        **{f"drift_limit_{name}": value for name, value in vars(limits).items()},
        "dtype": dtype,
        "ranks": world.size,
        "layout": config.layout,
        "rows": len(layout.rows),
        "merge_breaks": layout.breaks,
    }
    stats = {name: json_number(value) for name, value in stats.items()}
    progress(
        f"run {plan.run_id}: drift over {drift.tokens} tokens ({dtype}): mean |Δ logprob| "
        f"{drift.mean_abs:.2e}, max {drift.max_abs:.2e}, KL {drift.kl:.2e}, "
        f"{drift.capped_share:.2%} of weights capped"
    )
    refusal = drift.refusal(limits)
    if refusal is not None:
        progress(f"run {plan.run_id}: refused: {refusal}")
        if engine is None:
            return CycleResult(plan.run_id, TrainingRunStatus.refused, refusal, None)
        return finish_run(
            engine, plan.run_id, TrainingRunStatus.refused, reason=refusal, stats=stats
        )

    if not world.is_main:
        update_policy(policy, samples, old_logprobs, config, device, progress, world)
        return share(CycleResult(plan.run_id, TrainingRunStatus.running, None, None), world)

    assert engine is not None and held_out is not None and reference is not None
    tokenizer = PreTrainedTokenizerFast.from_pretrained(base_model)
    production_weights = trainable_state(policy)
    production_pass = held_out.pass_rate(policy, tokenizer)
    progress(f"run {plan.run_id}: production held-out pass rate {production_pass:.3f}")
    logged = LoggedSlice.select(engine, config, plan.production_id)
    logged.score_production(policy, config)

    stats |= update_policy(policy, samples, old_logprobs, config, device, progress, world)
    stats["reward_mean_before"] = sum(s.reward for s in samples) / len(samples)
    try:
        result = judge_and_publish(
            settings,
            config,
            plan,
            policy,
            engine=engine,
            held_out=held_out,
            tokenizer=tokenizer,
            reference=reference,
            production_weights=production_weights,
            production_pass=production_pass,
            logged=logged,
            stats=stats,
            progress=progress,
            on_published=on_published,
        )
    except BaseException as exc:
        share(CycleResult(plan.run_id, TrainingRunStatus.failed, repr(exc), None), world)
        raise
    return share(result, world)


def judge_and_publish(
    settings: Settings,
    config: TrainConfig,
    plan: CyclePlan,
    policy: torch.nn.Module,
    *,
    engine: Engine,
    held_out: HeldOut,
    tokenizer: PreTrainedTokenizerFast,
    reference: Reference,
    production_weights: dict[str, torch.Tensor],
    production_pass: float,
    logged: LoggedSlice,
    stats: dict[str, Any],
    progress: Callable[[str], None],
    on_published: Callable[[], None] | None,
) -> CycleResult:
    """Rank 0 after the update: the evaluation gate, the candidate's predicted A/B, then save,
    publish and start a canary."""
    with session_scope(engine) as session:
        erased = erased_since_selected(session, plan.samples)
    if erased:
        # The update learned from them: no checkpoint trained on an erased user is published.
        reason = f"{erased} samples of the batch were erased during the cycle"
        progress(f"run {plan.run_id}: rejected: {reason}")
        return finish_run(
            engine, plan.run_id, TrainingRunStatus.rejected, reason=reason, stats=stats
        )
    prediction = logged.predict(policy, config, plan.window)
    if prediction is not None:
        progress(f"run {plan.run_id}: {prediction_summary(prediction)}")
    candidate_pass = held_out.pass_rate(policy, tokenizer)
    kl = kl_to_production(policy, production_weights, reference.answers)
    agent_kl = (
        kl_to_production(policy, production_weights, reference.agent_turns)
        if reference.agent_turns is not None
        else None
    )
    result = gate(
        held_out.name,
        production_pass,
        candidate_pass,
        kl,
        agent_kl,
        max_regression=config.eval_max_regression,
        max_kl=config.eval_max_kl,
    )
    on_agent_turns = f", {agent_kl:.4f} on agent turns" if agent_kl is not None else ""
    progress(
        f"run {plan.run_id}: candidate held-out pass rate {candidate_pass:.3f}, KL to "
        f"production {kl:.4f} on answers{on_agent_turns}"
    )
    if not result.passed:
        progress(f"run {plan.run_id}: rejected: {result.reason}")
        return finish_run(
            engine,
            plan.run_id,
            TrainingRunStatus.rejected,
            reason=result.reason,
            stats=stats,
            eval_results=result.as_dict(),
            prediction=prediction,
        )
    margin = config.prediction_gate_margin
    held = None if prediction is None or margin is None else hold_reason(prediction, margin)
    if held is not None and prediction is not None:
        progress(f"run {plan.run_id}: held before its canary: {held}")
        with session_scope(engine) as session:
            audit(
                session,
                TRAINER_ACTOR,
                "training_run.held",
                f"training_run:{plan.run_id}",
                None,
                {"reason": held, "prediction": prediction["kinds"]["all"]["mean_reward"]},
            )
        return finish_run(
            engine,
            plan.run_id,
            TrainingRunStatus.rejected,
            reason=held,
            stats=stats,
            eval_results=result.as_dict(),
            prediction=prediction,
        )

    adapter_dir = settings.data_dir.resolve() / "runs" / f"run-{plan.run_id}" / "adapter"
    policy.save_pretrained(str(adapter_dir))  # type: ignore[operator]
    checkpoint = publish_checkpoint(
        engine,
        adapter_dir,
        parent=plan.production_name,
        replicas=settings.vllm_urls,
        checkpoints_dir=settings.checkpoints_dir.resolve(),
        base_model=str(settings.base_model_path),
        reward_version=settings.reward_version,
        api_key=settings.vllm_api_key.get_secret_value(),
        manifest={
            "training_run": plan.run_id,
            "data_window": list(plan.window),
            "samples": len(plan.samples),
        },
    )
    with session_scope(engine) as session:
        control = session.get_one(Checkpoint, plan.production_id)
        treatment = session.get_one(Checkpoint, checkpoint.id)
        start_canary(
            session,
            control=control,
            treatment=treatment,
            treatment_bps=config.canary_bps,
            created_by=f"trainer run {plan.run_id}",
            actor=TRAINER_ACTOR,
        )
        superseded = ", ".join(
            session.scalars(
                select(Checkpoint.name).where(Checkpoint.superseded_by_id == treatment.id)
            )
        )
    if on_published is not None:
        on_published()
    progress(
        f"run {plan.run_id}: published {checkpoint.name} as a {config.canary_bps / 100:g}% canary"
    )
    if superseded:
        progress(f"run {plan.run_id}: the canary {superseded} is superseded by {checkpoint.name}")
    return finish_run(
        engine,
        plan.run_id,
        TrainingRunStatus.published,
        reason=f"superseded the canary {superseded}" if superseded else None,
        stats=stats,
        eval_results=result.as_dict(),
        prediction=prediction,
        output_checkpoint_id=checkpoint.id,
    )


def json_number(value: Any) -> Any:
    """JSONB holds no NaN or infinity: those become null (no limit, or nothing measured)."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value
