"""One real training cycle: samples served by vLLM, rewards in Postgres, update, publish."""

from __future__ import annotations

import math
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import Engine, func, select
from transformers import PreTrainedTokenizerFast

from app.config import Settings
from app.db import session_scope
from app.models import (
    AuditEntry,
    Checkpoint,
    CheckpointStatus,
    Experiment,
    ExperimentStatus,
    Reward,
    Sample,
    TrainingRun,
    TrainingRunStatus,
)
from app.serving.parity import logprob_drift, recompute_logprobs
from app.serving.replicas import load_adapter, unload_adapter
from app.serving.sampling import ServedCompletion, sample_completions
from app.serving.vllm import VllmServer
from app.signals.rewards import RewardComponents
from sandbox.task_family import task_family_held_out
from sandbox.tasks import Task, check_solution, extract_code, train_tasks
from trainer import cycle as cycle_module
from trainer.config import TrainConfig
from trainer.cycle import CycleResult, run_cycle
from trainer.drift import DEFAULT_DRIFT_LIMITS
from trainer.generation import prompt_ids
from trainer.lock import CycleBusy, trainer_lock

Served = list[tuple[Task, ServedCompletion]]


def solves(task: Task, completion: ServedCompletion) -> bool:
    return check_solution(task, extract_code(completion.text) or "")


def sample(server: VllmServer, model_dir: Path, model: str, tasks: list[Task]) -> Served:
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    prompts = [prompt_ids(tokenizer, task.request) for task in tasks]
    completions = sample_completions(server.url, model, prompts, max_tokens=48)
    return list(zip(tasks, completions, strict=True))


PROMPTS, SAMPLES_PER_PROMPT = 64, 8


@pytest.fixture(scope="module")
def base_served(vllm_server: VllmServer, tiny_model_dir: Path) -> Served:
    """Completions the base model served for training tasks, with vLLM's logprobs: eight per
    prompt, the prompts in the same order each round (so the first 64 are 64 distinct tasks).

    Repeated prompts are what the trainer's group baseline needs: each completion is judged
    against the others for its own prompt, not against the batch's mean."""
    tasks = train_tasks(seed=7, n=PROMPTS) * SAMPLES_PER_PROMPT
    return sample(vllm_server, tiny_model_dir, "base", tasks)


@pytest.fixture
def registry(clean_registry: Engine) -> Engine:
    return clean_registry


def record(
    engine: Engine,
    served: Served,
    reward: Callable[[Task, ServedCompletion], float],
    *,
    logprob_shift: float = 0.0,
) -> None:
    """Store served completions as base-model samples with finalized rewards."""
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        for task, completion in served:
            row = Sample(
                event_id=uuid4(),
                request_id=f"req-{uuid4().hex}",
                session_id="trainer-test",
                user_hash="u",
                checkpoint="base",
                privacy=False,
                trainable=True,
                edit_requested=True,
                proposed_edit=extract_code(completion.text) is not None,
                prompt_token_ids=completion.prompt_token_ids,
                completion_token_ids=completion.completion_token_ids,
                behaviour_logprobs=[lp + logprob_shift for lp in completion.logprobs],
                completion_text=completion.text.replace("\x00", "\ufffd"),  # as workers store it
                status="ok",
                ttft_ms=1.0,
                latency_ms=2.0,
                served_at=now,
            )
            session.add(row)
            session.flush()
            value = reward(task, completion)
            components = RewardComponents(
                edit_requested=True,
                proposed_edit=row.proposed_edit,
                accepted=value > 0,
                kept=value,
                survival_elapsed_s=900.0 if value > 0 else None,
                dissatisfied=None,
                latency_ms=2.0,
                latency_over_budget=False,
                malformed_tool_calls=0,
                status="ok",
            )
            session.add(
                Reward(
                    sample_id=row.id,
                    components=components.model_dump(mode="json"),
                    reward=value,
                    reward_version=1,
                    due_at=now,
                    finalized_at=now,
                    finalize_reason="horizon",
                )
            )


def settings_for(server: VllmServer, model_dir: Path, data_dir: Path) -> Settings:
    return Settings(data_dir=data_dir, vllm_urls=[server.url], base_model=model_dir)


def cycle_on_tasks(settings: Settings, config: TrainConfig, *, engine: Engine) -> CycleResult:
    """A cycle whose evaluation gate scores the task family's held-out set."""
    return run_cycle(settings, config, engine=engine, held_out=task_family_held_out(config))


def fast_config(**overrides: object) -> TrainConfig:
    config = TrainConfig(
        min_samples=64,
        epochs=4,
        learning_rate=2e-3,
        minibatch_size=64,
        eval_tasks=32,
        eval_max_regression=0.25,
        eval_max_kl=5.0,
        threads=1,
        prediction_percent=0,  # every sample trains; tests/trainer/test_prediction.py predicts
    )
    for name, value in overrides.items():
        setattr(config, name, value)
    return config


def published_checkpoints(engine: Engine) -> list[str]:
    with session_scope(engine) as session:
        return list(session.scalars(select(Checkpoint.name).where(Checkpoint.name != "base")))


@pytest.mark.slow
def test_a_cycle_makes_the_rewarded_behaviour_more_frequent(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served, lambda task, done: float(solves(task, done)))

    # A wider trust region than production's 0.2: the clip bounds how far one cycle moves
    # each token's probability (measured on the base model: +3 pp at 0.2, +8.5 pp at 0.4).
    config = fast_config(clip_epsilon=0.4)
    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path), config, engine=registry
    )

    assert result.status == TrainingRunStatus.published, result.reason
    assert result.checkpoint is not None
    with session_scope(registry) as session:
        checkpoint = session.scalar(select(Checkpoint).where(Checkpoint.name == result.checkpoint))
        assert checkpoint is not None and checkpoint.status == CheckpointStatus.canary
        experiment = session.scalar(
            select(Experiment).where(Experiment.status == ExperimentStatus.running)
        )
        assert experiment is not None
        weights = {arm.name: arm.weight_bps for arm in experiment.arms}
        assert weights == {"control": 9000, "treatment": 1000}
        run = session.get_one(TrainingRun, result.run_id)
        assert run.sample_count == len(base_served)
        assert run.stats is not None and run.stats["tokens_per_s"] > 0
        stats = run.stats
        # How far the update moved from production: on the tokens it trained on, and on the
        # gate's fixed answers and agent turns.
        assert stats["kl_to_production"] > 0
        assert run.eval_results is not None
        assert run.eval_results["kl_to_production"] > 0
        assert run.eval_results["agent_kl_to_production"] > 0
        adapter_path = Path(str(checkpoint.adapter_path))

    # Drift was measured on every token vLLM sampled: fp32 on both sides agrees to ~1e-6.
    tokens = sum(len(completion.completion_token_ids) for _, completion in base_served)
    assert (stats["drift_tokens"], stats["dtype"], stats["ranks"]) == (tokens, "fp32", 1)
    assert stats["drift_mean_abs"] < 1e-5 and stats["drift_max_abs"] < 1e-4
    assert 0 <= stats["drift_kl"] < 1e-8 and stats["drift_capped_share"] == 0
    assert stats["drift_limit_max_abs"] == 1e-3
    print(
        f"drift over {tokens} tokens, fp32: mean |Δ| {stats['drift_mean_abs']:.2e}, "
        f"max {stats['drift_max_abs']:.2e}, KL {stats['drift_kl']:.2e}"
    )

    # Parameters changed: a fresh LoRA starts with B = 0, so any non-zero B was learnt.
    weights_after = load_file(str(adapter_path / "adapter_model.safetensors"))
    lora_b = [tensor for name, tensor in weights_after.items() if "lora_B" in name]
    assert lora_b and max(float(t.abs().max()) for t in lora_b) > 0

    # The rewarded behaviour (solving the task) is more frequent when vLLM samples the
    # new checkpoint, on the same prompts, in fresh samples: 64 per prompt and model, and the
    # difference at least two standard errors above zero. The error is that of the mean over
    # these prompts (each prompt's binomial error, summed): the prompts are the same on both
    # sides, so how hard one prompt is does not enter it. Measured in 13 runs on five bases
    # (seeds 1 to 5 of the 500-step bootstrap): +7.9 to +17.1 pp, 8.6 to 18 standard errors.
    tasks = [task for task, _ in base_served[:PROMPTS]] * 64
    before = sample(vllm_server, tiny_model_dir, "base", tasks)
    after = sample(vllm_server, tiny_model_dir, result.checkpoint, tasks)
    solved_before, solved_after = solved_by_task(before), solved_by_task(after)
    rate_before = sum(map(sum, solved_before.values())) / len(before)
    rate_after = sum(map(sum, solved_after.values())) / len(after)
    error = math.sqrt(
        sum(
            binomial_variance(solved_before[task]) + binomial_variance(solved_after[task])
            for task in solved_before
        )
    ) / len(solved_before)
    learnable = sum(0 < sum(runs) < len(runs) for runs in solved_by_task(base_served).values())
    print(
        f"pass rate sampled through vLLM: base {rate_before:.3f} -> new {rate_after:.3f} "
        f"(standard error of the difference {error:.4f}); trained on {learnable} of "
        f"{PROMPTS} prompts with mixed rewards, loss {stats['loss']:+.4f}, clip fraction "
        f"{stats['clip_fraction']:.3f}, {stats['optimizer_steps']} steps"
    )

    # What vLLM served as the new checkpoint is the trained adapter: its logprobs of what it
    # sampled are the adapter's, recomputed in fp32, and far from the base model's.
    served = [completion for _, completion in after[:PROMPTS]]
    prompts = [completion.prompt_token_ids for completion in served]
    completions = [completion.completion_token_ids for completion in served]
    logged = [completion.logprobs for completion in served]
    cpu = torch.device("cpu")
    trained = logprob_drift(
        logged,
        recompute_logprobs(
            tiny_model_dir, prompts, completions, adapter_dir=adapter_path, device=cpu
        ),
    )
    untrained = logprob_drift(
        logged, recompute_logprobs(tiny_model_dir, prompts, completions, device=cpu)
    )
    print(
        f"{result.checkpoint} as served against the trained adapter: max |Δ| "
        f"{trained.max_abs:.2e}; against the base model: mean |Δ| {untrained.mean_abs:.2e}"
    )
    assert trained.within(1e-3)
    assert untrained.mean_abs > 10 * trained.mean_abs

    assert rate_after - rate_before > 2 * error


def solved_by_task(served: Served) -> dict[str, list[bool]]:
    """Whether each completion solved its task, by task, in order."""
    solved: dict[str, list[bool]] = {}
    for task, completion in served:
        solved.setdefault(task.task_id, []).append(solves(task, completion))
    return solved


def binomial_variance(outcomes: list[bool]) -> float:
    """The variance of the share of successes in `outcomes`."""
    rate = sum(outcomes) / len(outcomes)
    return rate * (1 - rate) / len(outcomes)


def test_too_few_samples_records_a_skipped_run(
    registry: Engine, vllm_server: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path), fast_config(), engine=registry
    )
    assert result.status == TrainingRunStatus.skipped
    assert result.reason is not None and "0 finalized on-policy samples" in result.reason
    assert published_checkpoints(registry) == []


def test_drift_between_serving_and_training_refuses_to_train(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served[:64], lambda *_: 1.0, logprob_shift=0.05)
    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path), fast_config(), engine=registry
    )
    assert result.status == TrainingRunStatus.refused
    assert result.reason is not None and "drift" in result.reason
    assert published_checkpoints(registry) == []


@pytest.mark.slow
def test_a_healthy_bf16_cycle_trains_where_fp32_limits_would_refuse_it(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    """The trainer in bf16 against vLLM's fp32 logprobs: rounding, not a real mismatch."""
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    settings = settings_for(vllm_server, tiny_model_dir, tmp_path)
    fp32 = DEFAULT_DRIFT_LIMITS["fp32"]
    strict = fast_config(
        epochs=1, dtype="bf16", drift_max_abs=fp32.max_abs, drift_mean_abs=fp32.mean_abs
    )
    refused = cycle_on_tasks(settings, strict, engine=registry)
    healthy = cycle_on_tasks(settings, fast_config(epochs=1, dtype="bf16"), engine=registry)

    assert refused.status == TrainingRunStatus.refused
    assert refused.reason is not None and "mean |logged - recomputed|" in refused.reason
    assert healthy.status == TrainingRunStatus.published, healthy.reason
    with session_scope(registry) as session:
        stats = session.get_one(TrainingRun, healthy.run_id).stats
    assert stats is not None and stats["dtype"] == "bf16"
    assert stats["drift_limit_max_abs"] is None  # bf16 has no per-token limit
    assert fp32.mean_abs < stats["drift_mean_abs"] < stats["drift_limit_mean_abs"]


def test_logprobs_of_another_checkpoint_are_refused_in_bf16_too(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    lora_dir: Path,
    tmp_path: Path,
) -> None:
    """Samples served by one adapter and recorded as the base's: the mismatch is real."""
    load_adapter(vllm_server.url, "drift-other-checkpoint", lora_dir)
    try:
        served = sample(vllm_server, tiny_model_dir, "drift-other-checkpoint", train_tasks(7, 64))
    finally:
        unload_adapter(vllm_server.url, "drift-other-checkpoint")
    record(registry, served, lambda task, done: float(solves(task, done)))

    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path),
        fast_config(dtype="bf16"),
        engine=registry,
    )

    assert result.status == TrainingRunStatus.refused
    assert result.reason is not None and "KL(vLLM || trainer) per token" in result.reason
    with session_scope(registry) as session:
        stats = session.get_one(TrainingRun, result.run_id).stats
    assert stats is not None and stats["drift_kl"] > 1.0 and stats["drift_capped_share"] > 0.02
    assert published_checkpoints(registry) == []


@pytest.mark.slow
def test_a_candidate_that_fails_the_eval_gate_is_not_published(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path),
        fast_config(epochs=1, eval_max_kl=0.0),
        engine=registry,
    )
    assert result.status == TrainingRunStatus.rejected
    assert result.reason is not None and "KL to production" in result.reason
    assert published_checkpoints(registry) == []


def test_only_one_cycle_runs_at_a_time(
    registry: Engine, vllm_server: VllmServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    with trainer_lock(registry), pytest.raises(CycleBusy):
        cycle_on_tasks(
            settings_for(vllm_server, tiny_model_dir, tmp_path), fast_config(), engine=registry
        )


class ProcessDied(BaseException):
    """Stands in for the trainer being killed: no `except Exception` handler runs."""


@pytest.mark.slow
def test_a_crash_between_saving_and_registering_leaves_nothing_half_published(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    settings = settings_for(vllm_server, tiny_model_dir, tmp_path)

    def die(*args: object, **kwargs: object) -> None:
        raise ProcessDied

    monkeypatch.setattr(cycle_module, "publish_checkpoint", die)
    with pytest.raises(ProcessDied):
        cycle_on_tasks(settings, fast_config(epochs=1), engine=registry)
    assert list((tmp_path / "runs").glob("run-*/adapter/adapter_model.safetensors"))
    assert published_checkpoints(registry) == []

    monkeypatch.undo()
    result = cycle_on_tasks(settings, fast_config(epochs=1), engine=registry)
    with session_scope(registry) as session:
        statuses = dict(session.execute(select(TrainingRun.id, TrainingRun.status)).all())
        reasons = session.scalars(select(TrainingRun.reason)).all()
    assert statuses[result.run_id] == TrainingRunStatus.published
    assert sorted(statuses.values()) == [TrainingRunStatus.failed, TrainingRunStatus.published]
    assert any("died" in (reason or "") for reason in reasons)
    assert published_checkpoints(registry) == [result.checkpoint]


@pytest.mark.slow
def test_a_newer_candidate_supersedes_the_canary_and_a_repeat_without_new_samples_skips(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    settings = settings_for(vllm_server, tiny_model_dir, tmp_path)
    config = fast_config(epochs=1)
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    first = cycle_on_tasks(settings, config, engine=registry)
    record(registry, base_served[64:128], lambda task, done: float(solves(task, done)))
    second = cycle_on_tasks(settings, config, engine=registry)
    repeat = cycle_on_tasks(settings, config, engine=registry)

    assert (first.status, second.status) == (TrainingRunStatus.published,) * 2, second.reason
    assert second.reason == f"superseded the canary {first.checkpoint}"
    assert repeat.status == TrainingRunStatus.skipped
    assert repeat.reason is not None and repeat.reason.startswith(
        f"no new on-policy evidence: 0 finalized samples of base served after the window of "
        f"run {second.run_id}"
    )
    with session_scope(registry) as session:
        older = session.scalars(select(Checkpoint).where(Checkpoint.name == first.checkpoint)).one()
        newer = session.scalars(
            select(Checkpoint).where(Checkpoint.name == second.checkpoint)
        ).one()
        assert (older.status, older.superseded_by_id) == (CheckpointStatus.retired, newer.id)
        assert newer.status == CheckpointStatus.canary
        running = session.scalars(
            select(Experiment).where(Experiment.status == ExperimentStatus.running)
        ).one()
        assert {arm.checkpoint_id for arm in running.arms if not arm.is_control} == {newer.id}
        retired = session.scalars(
            select(AuditEntry).where(AuditEntry.target == f"checkpoint:{first.checkpoint}")
        ).one()
        assert (retired.actor, retired.action) == ("trainer", "checkpoint.retire")


def test_privacy_and_untrainable_samples_are_never_selected(
    registry: Engine, base_served: Served
) -> None:
    from trainer.data import select_on_policy_batch

    record(registry, base_served[:10], lambda *_: 1.0)
    # Served last, its reward still open: it is not trained on, nor would anything served
    # after it be (the cohort ends where the first open reward was served).
    record(registry, base_served[:1], lambda *_: 1.0)
    with session_scope(registry) as session:
        ids = session.scalars(select(Sample.id).order_by(Sample.id)).all()
        session.execute(
            Reward.__table__.update().where(Reward.sample_id == ids[10]).values(finalized_at=None)
        )
        session.execute(
            Sample.__table__.update().where(Sample.id.in_(ids[:3])).values(privacy=True)
        )
        session.execute(
            Sample.__table__.update().where(Sample.id.in_(ids[3:5])).values(trainable=False)
        )
        production = session.scalar(select(Checkpoint).where(Checkpoint.name == "base"))
        assert production is not None
        batch = select_on_policy_batch(session, production, max_samples=100)
        total = session.scalar(select(func.count()).select_from(Sample))
    assert total == 11
    assert sorted(s.sample_id for s in batch.samples) == sorted(ids[5:10])
