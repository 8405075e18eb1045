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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
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
from app.signals.rewards import REWARD_OPEN_LIMIT
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
    GateResult,
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
class CycleContext:
    """What rank 0 runs a cycle with: the deployment, the trainer's knobs, the registry, the
    gate's held-out set, where progress goes and the ranks that train with it."""

    settings: Settings
    config: TrainConfig
    engine: Engine
    held_out: HeldOut
    """What the evaluation gate scores the candidate on."""
    progress: Callable[[str], None] = log.info
    on_published: Callable[[], None] | None = None
    """Called once a candidate is published as a canary."""
    trigger: CycleTrigger = CycleTrigger.manual
    world: World = SINGLE


@dataclass(frozen=True)
class CyclePlan:
    """What rank 0 decided to train on, shared with every rank."""

    run_id: int
    production_id: int
    production_name: str
    production_adapter: str | None
    samples: list[TrainingSample]
    window: tuple[datetime | None, datetime | None]


@dataclass(frozen=True)
class Trainee:
    """Production's policy on this rank, about to be updated: its own logprobs of the batch
    (the drift check's and the PPO ratio's), the drift statistics, and the refusal when the
    drift is beyond its limits."""

    policy: torch.nn.Module
    device: torch.device
    old_logprobs: list[list[float]]
    stats: dict[str, Any]
    refusal: str | None


@dataclass(frozen=True)
class ProductionBaseline:
    """Production as rank 0 measured it before the update: what the candidate is judged
    against."""

    tokenizer: PreTrainedTokenizerFast
    reference: Reference
    weights: dict[str, torch.Tensor]
    """The LoRA's weights before the update, for the KL to production."""
    pass_rate: float
    logged: LoggedSlice


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
    cycle = CycleContext(settings, config, engine, held_out, progress, on_published, trigger, world)
    with trainer_lock(engine):
        return run_locked_cycle(cycle)


def run_locked_cycle(cycle: CycleContext) -> CycleResult:
    """`run_cycle` for a caller that holds the trainer lock already (rank 0)."""
    try:
        planned = plan_cycle(cycle)
        if isinstance(planned, CycleResult):
            return share(planned, cycle.world)
    except BaseException:
        nothing: CyclePlan | CycleResult | None = None
        share(nothing, cycle.world)  # the other ranks stop waiting
        raise
    plan, reference = planned
    share(plan, cycle.world)
    try:
        with cycle_threads(cycle.config):
            return train_and_publish(cycle, plan, reference)
    except Exception as exc:
        reason = f"{type(exc).__name__}: {exc}"
        finish_run(cycle.engine, plan.run_id, TrainingRunStatus.failed, reason=reason)
        raise


def plan_cycle(cycle: CycleContext) -> tuple[CyclePlan, Reference] | CycleResult:
    """Rank 0: clean up after a crashed run, open a run on production's batch and take the
    gate's reference; the skipped run when there is nothing to train on or judge with."""
    if abandon_crashed_runs(cycle.engine):
        unload_unregistered_adapters(cycle)
    withheld_percent = max(cycle.held_out.withheld_percent, cycle.config.prediction_percent)
    run_id, production, batch, previous = open_run(
        cycle.engine,
        cycle.config,
        cycle.trigger,
        withheld_percent,
        open_limit=cycle.settings.reward_open_limit,
    )
    cycle.progress(f"run {run_id}: {len(batch.samples)} on-policy samples of {production.name}")
    skip = skip_reason(batch, previous, cycle.config)
    reference = None
    if skip is None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(cycle.settings.base_model_path)
        try:
            reference = cycle.held_out.reference(tokenizer)
        except HeldOutUnavailable as exc:
            skip = str(exc)
    if skip is not None or reference is None:
        cycle.progress(f"run {run_id}: skipped: {skip}")
        return finish_run(cycle.engine, run_id, TrainingRunStatus.skipped, reason=skip)
    plan = CyclePlan(
        run_id=run_id,
        production_id=production.id,
        production_name=production.name,
        production_adapter=production.adapter_path,
        samples=batch.samples,
        window=(batch.window_start, batch.window_end),
    )
    return plan, reference


def unload_unregistered_adapters(cycle: CycleContext) -> None:
    """A run that died while publishing may have left its adapter on a replica: unload it."""
    settings = cycle.settings
    report = reconcile(
        cycle.engine, settings.vllm_urls, api_key=settings.vllm_api_key.get_secret_value()
    )
    for replica, names in report.unloaded.items():
        cycle.progress(f"unloaded unregistered {', '.join(names)} from {replica}")
    for error in report.errors:
        cycle.progress(f"reconcile: {error}")


def follow_cycle(settings: Settings, config: TrainConfig, world: World) -> CycleResult:
    """A rank other than 0: wait for rank 0's plan, train with it, return its outcome."""
    plan: CyclePlan | CycleResult | None = None
    plan = share(plan, world)
    if plan is None:
        raise RuntimeError("rank 0 failed before it shared its plan; see its log")
    if isinstance(plan, CycleResult):
        return plan  # nothing to train
    with cycle_threads(config):
        return train_with_rank_0(settings, config, plan, world)


@contextmanager
def cycle_threads(config: TrainConfig) -> Iterator[None]:
    """Torch's CPU threads set to `config.threads` for the cycle (0: left as they are)."""
    threads = torch.get_num_threads()
    try:
        if config.threads:
            torch.set_num_threads(config.threads)
        yield
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
    engine: Engine,
    config: TrainConfig,
    trigger: CycleTrigger,
    withheld_percent: int = 0,
    open_limit: timedelta = REWARD_OPEN_LIMIT,
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
            session,
            production,
            max_samples=config.max_samples,
            withheld_percent=withheld_percent,
            max_share=config.max_source_share,
            open_limit=open_limit,
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
            config=config.model_dump(),
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


def train_with_rank_0(
    settings: Settings, config: TrainConfig, plan: CyclePlan, world: World
) -> CycleResult:
    """A rank other than 0: the drift check and its share of the update; rank 0's outcome."""
    trainee = measure_drift_or_refuse(settings, config, plan, world, log.debug)
    if trainee.refusal is not None:
        return CycleResult(plan.run_id, TrainingRunStatus.refused, trainee.refusal, None)
    update_policy(
        trainee.policy, plan.samples, trainee.old_logprobs, config, trainee.device, log.debug, world
    )
    return share(CycleResult(plan.run_id, TrainingRunStatus.running, None, None), world)


def train_and_publish(cycle: CycleContext, plan: CyclePlan, reference: Reference) -> CycleResult:
    """Rank 0: drift check, production's scores, the update (with the other ranks), then the
    evaluation gate, save, publish, canary, and the run's record."""
    config, world = cycle.config, cycle.world
    trainee = measure_drift_or_refuse(cycle.settings, config, plan, world, cycle.progress)
    if trainee.refusal is not None:
        return finish_run(
            cycle.engine,
            plan.run_id,
            TrainingRunStatus.refused,
            reason=trainee.refusal,
            stats=trainee.stats,
        )
    production = measure_production(cycle, plan, trainee.policy, reference)
    samples = plan.samples
    stats = trainee.stats | update_policy(
        trainee.policy, samples, trainee.old_logprobs, config, trainee.device, cycle.progress, world
    )
    stats["reward_mean_before"] = sum(s.reward for s in samples) / len(samples)
    try:
        result = judge_and_publish(cycle, plan, trainee.policy, production, stats)
    except BaseException as exc:
        share(CycleResult(plan.run_id, TrainingRunStatus.failed, repr(exc), None), world)
        raise
    return share(result, world)


def load_production_policy(
    settings: Settings, config: TrainConfig, plan: CyclePlan, world: World
) -> tuple[torch.nn.Module, torch.device, str]:
    """Seeded: production's policy (the base and its adapter) on this rank's device, that
    device, and the policy's dtype."""
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    device = pick_device(config, world)
    dtype = policy_dtype(config, device)
    adapter = Path(plan.production_adapter) if plan.production_adapter else None
    policy = load_trainable_policy(settings.base_model_path, adapter, config, device)
    return policy, device, dtype


def measure_drift_or_refuse(
    settings: Settings,
    config: TrainConfig,
    plan: CyclePlan,
    world: World,
    progress: Callable[[str], None],
) -> Trainee:
    """Every rank: production's policy and its logprobs of every token vLLM sampled, against
    vLLM's own (serving/training drift); refused when they disagree beyond the limits."""
    policy, device, dtype = load_production_policy(settings, config, plan, world)
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
    return Trainee(policy, device, old_logprobs, stats, refusal)


def measure_production(
    cycle: CycleContext, plan: CyclePlan, policy: torch.nn.Module, reference: Reference
) -> ProductionBaseline:
    """Rank 0, before the update: production's weights, its held-out pass rate, and its
    scores of the logged slice the candidate's A/B is predicted on."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(cycle.settings.base_model_path)
    weights = trainable_state(policy)
    pass_rate = cycle.held_out.pass_rate(policy, tokenizer)
    cycle.progress(f"run {plan.run_id}: production held-out pass rate {pass_rate:.3f}")
    logged = LoggedSlice.select(cycle.engine, cycle.config, plan.production_id)
    logged.score_production(policy, cycle.config)
    return ProductionBaseline(tokenizer, reference, weights, pass_rate, logged)


def judge_and_publish(
    cycle: CycleContext,
    plan: CyclePlan,
    policy: torch.nn.Module,
    production: ProductionBaseline,
    stats: dict[str, Any],
) -> CycleResult:
    """Rank 0 after the update: the evaluation gate, the candidate's predicted A/B, then save,
    publish and start a canary."""
    erased = refuse_if_erased(cycle, plan, stats)
    if erased is not None:
        return erased
    prediction = production.logged.predict(policy, cycle.config, plan.window)
    if prediction is not None:
        cycle.progress(f"run {plan.run_id}: {prediction_summary(prediction)}")
    verdict = gate_candidate(cycle, plan, policy, production)
    if not verdict.passed:
        cycle.progress(f"run {plan.run_id}: rejected: {verdict.reason}")
        return finish_run(
            cycle.engine,
            plan.run_id,
            TrainingRunStatus.rejected,
            reason=verdict.reason,
            stats=stats,
            eval_results=verdict.as_dict(),
            prediction=prediction,
        )
    held = hold_on_prediction(cycle, plan, prediction)
    if held is not None:
        return finish_run(
            cycle.engine,
            plan.run_id,
            TrainingRunStatus.rejected,
            reason=held,
            stats=stats,
            eval_results=verdict.as_dict(),
            prediction=prediction,
        )
    return publish_as_canary(cycle, plan, policy, stats, verdict, prediction)


def refuse_if_erased(
    cycle: CycleContext, plan: CyclePlan, stats: dict[str, Any]
) -> CycleResult | None:
    """The rejected run when samples of the batch were erased during the cycle: the update
    learned from them, and no checkpoint trained on an erased user is published."""
    with session_scope(cycle.engine) as session:
        erased = erased_since_selected(session, plan.samples)
    if not erased:
        return None
    reason = f"{erased} samples of the batch were erased during the cycle"
    cycle.progress(f"run {plan.run_id}: rejected: {reason}")
    return finish_run(
        cycle.engine, plan.run_id, TrainingRunStatus.rejected, reason=reason, stats=stats
    )


def gate_candidate(
    cycle: CycleContext, plan: CyclePlan, policy: torch.nn.Module, production: ProductionBaseline
) -> GateResult:
    """The evaluation gate: the candidate's held-out pass rate against production's, and how
    far it moved from production on the gate's reference answers and agent turns."""
    config = cycle.config
    candidate_pass = cycle.held_out.pass_rate(policy, production.tokenizer)
    reference = production.reference
    kl = kl_to_production(policy, production.weights, reference.answers)
    agent_kl = (
        kl_to_production(policy, production.weights, reference.agent_turns)
        if reference.agent_turns is not None
        else None
    )
    result = gate(
        cycle.held_out.name,
        production.pass_rate,
        candidate_pass,
        kl,
        agent_kl,
        max_regression=config.eval_max_regression,
        max_kl=config.eval_max_kl,
    )
    on_agent_turns = f", {agent_kl:.4f} on agent turns" if agent_kl is not None else ""
    cycle.progress(
        f"run {plan.run_id}: candidate held-out pass rate {candidate_pass:.3f}, KL to "
        f"production {kl:.4f} on answers{on_agent_turns}"
    )
    return result


def hold_on_prediction(
    cycle: CycleContext, plan: CyclePlan, prediction: dict[str, Any] | None
) -> str | None:
    """Why a candidate that passed the gate is held before its canary: its mean reward
    predicted, reliably, below production's by more than `prediction_gate_margin` (audited);
    None: it goes on to its canary."""
    margin = cycle.config.prediction_gate_margin
    held = None if prediction is None or margin is None else hold_reason(prediction, margin)
    if held is None or prediction is None:
        return None
    cycle.progress(f"run {plan.run_id}: held before its canary: {held}")
    with session_scope(cycle.engine) as session:
        audit(
            session,
            TRAINER_ACTOR,
            "training_run.held",
            f"training_run:{plan.run_id}",
            None,
            {"reason": held, "prediction": prediction["kinds"]["all"]["mean_reward"]},
        )
    return held


def publish_as_canary(
    cycle: CycleContext,
    plan: CyclePlan,
    policy: torch.nn.Module,
    stats: dict[str, Any],
    verdict: GateResult,
    prediction: dict[str, Any] | None,
) -> CycleResult:
    """Save the candidate's adapter, publish it to every replica, and route `canary_bps` of
    users to it against production; the run's record names the canary it superseded."""
    settings, config = cycle.settings, cycle.config
    adapter_dir = settings.data_dir.resolve() / "runs" / f"run-{plan.run_id}" / "adapter"
    policy.save_pretrained(str(adapter_dir))  # type: ignore[operator]
    checkpoint = publish_checkpoint(
        cycle.engine,
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
    superseded = start_canary_against_production(cycle, plan, checkpoint.id)
    if cycle.on_published is not None:
        cycle.on_published()
    cycle.progress(
        f"run {plan.run_id}: published {checkpoint.name} as a {config.canary_bps / 100:g}% canary"
    )
    if superseded:
        cycle.progress(
            f"run {plan.run_id}: the canary {superseded} is superseded by {checkpoint.name}"
        )
    return finish_run(
        cycle.engine,
        plan.run_id,
        TrainingRunStatus.published,
        reason=f"superseded the canary {superseded}" if superseded else None,
        stats=stats,
        eval_results=verdict.as_dict(),
        prediction=prediction,
        output_checkpoint_id=checkpoint.id,
    )


def start_canary_against_production(
    cycle: CycleContext, plan: CyclePlan, checkpoint_id: int
) -> str:
    """Start the published checkpoint's canary against production; the canaries it
    superseded, by name (empty: none)."""
    with session_scope(cycle.engine) as session:
        control = session.get_one(Checkpoint, plan.production_id)
        treatment = session.get_one(Checkpoint, checkpoint_id)
        start_canary(
            session,
            control=control,
            treatment=treatment,
            treatment_bps=cycle.config.canary_bps,
            created_by=f"trainer run {plan.run_id}",
            actor=TRAINER_ACTOR,
        )
        return ", ".join(
            session.scalars(
                select(Checkpoint.name).where(Checkpoint.superseded_by_id == treatment.id)
            )
        )


def json_number(value: Any) -> Any:
    """JSONB holds no NaN or infinity: those become null (no limit, or nothing measured)."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    return value
