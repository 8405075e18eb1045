"""A candidate's A/B predicted from production's logs before its canary, through a real cycle
(vLLM samples, Postgres rewards, the trainer), and scored against what its canary realized."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from sqlalchemy import Engine, insert, select
from sqlalchemy.ext.asyncio import AsyncSession

from app.abtest.rollups import refresh_rollups
from app.analytics.scoreboard import prediction_scoreboard
from app.db import make_async_engine, session_scope
from app.models import Arm, Checkpoint, Reward, Sample, TrainingRun, TrainingRunStatus
from app.serving.parity import load_policy
from app.serving.sampling import ServedCompletion
from app.serving.vllm import VllmServer
from app.signals.rewards import RewardComponents
from sandbox.tasks import Task, train_tasks
from tests.trainer.test_cycle import (
    Served,
    cycle_on_tasks,
    fast_config,
    sample,
    settings_for,
    solves,
)
from trainer.prediction import predict, prediction_slice, score

USERS = 64
PERCENT = 50


@pytest.fixture(scope="module")
def served(vllm_server: VllmServer, tiny_model_dir: Path) -> Served:
    """Eight base-model answers to each of 64 training tasks, with vLLM's logprobs."""
    return sample(vllm_server, tiny_model_dir, "base", train_tasks(seed=11, n=64) * 8)


def record(
    engine: Engine, served: Served, reward: Callable[[int, Task, ServedCompletion], float]
) -> None:
    """Base-model samples of USERS users with final rewards; `reward` sees each sample's id."""
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        for index, (task, completion) in enumerate(served):
            row = Sample(
                event_id=uuid4(),
                request_id=f"req-{uuid4().hex}",
                session_id=f"s-{index}",
                user_hash=f"u{index % USERS}",
                checkpoint="base",
                privacy=False,
                trainable=True,
                edit_requested=True,
                proposed_edit=True,
                prompt_token_ids=completion.prompt_token_ids,
                completion_token_ids=completion.completion_token_ids,
                behaviour_logprobs=completion.logprobs,
                status="ok",
                ttft_ms=1.0,
                latency_ms=2.0,
                served_at=now,
            )
            session.add(row)
            session.flush()
            value = reward(row.id, task, completion)
            session.add(final_reward(row.id, value, now))


def final_reward(sample_id: int, value: float, at: datetime) -> Reward:
    components = RewardComponents(
        edit_requested=True,
        proposed_edit=True,
        accepted=value > 0,
        kept=value,
        survival_elapsed_s=900.0 if value > 0 else 0.0,
        dissatisfied=None,
        latency_ms=2.0,
        latency_over_budget=False,
        malformed_tool_calls=0,
        status="ok",
    )
    return Reward(
        sample_id=sample_id,
        components=components.model_dump(mode="json"),
        reward=value,
        reward_version=1,
        due_at=at,
        finalized_at=at,
        finalize_reason="horizon",
    )


def in_slice(sample_id: int) -> bool:
    return sample_id % 100 < PERCENT


def test_production_rescored_against_its_own_logs_predicts_no_difference(
    clean_registry: Engine, served: Served, tiny_model_dir: Path
) -> None:
    record(clean_registry, served, lambda _, task, done: float(solves(task, done)))
    with session_scope(clean_registry) as session:
        base = session.scalars(select(Checkpoint).where(Checkpoint.name == "base")).one()
        outcomes = prediction_slice(session, base, percent=PERCENT, limit=1024)
    assert 150 < len(outcomes) < 350 and all(in_slice(o.sample_id) for o in outcomes)

    production = score(load_policy(tiny_model_dir), outcomes, 8192)
    logged = [o.behaviour_logprobs for o in outcomes]
    # The candidate is the behaviour policy itself, as vLLM logged it.
    prediction = predict(outcomes, production, logged)

    assert prediction["identity"]["passed"]
    assert prediction["identity"]["mean_abs_log_ratio"] < 1e-3  # fp32 on both sides
    estimate = prediction["kinds"]["all"]["mean_reward"]
    assert abs(estimate["difference"]) < 1e-3
    # The weights differ from 1 by fp32 rounding, and the interval is as narrow (one run's
    # ended at −5e-9): it covers 0 to within that rounding.
    assert estimate["ci_low"] - 1e-6 <= 0 <= estimate["ci_high"] + 1e-6
    assert estimate["reliable"] and estimate["users"] == USERS
    assert estimate["diagnostics"]["effective_fraction"] > 0.99


def test_a_candidate_trained_against_the_outcome_is_predicted_worse_then_scored_by_its_canary(
    clean_registry: Engine,
    served: Served,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    stack: Any,
) -> None:
    # The trained share is rewarded for failing; the slice keeps the true outcome.
    def corrupted(sample_id: int, task: Task, done: ServedCompletion) -> float:
        solved = solves(task, done)
        return float(solved if in_slice(sample_id) else not solved)

    record(clean_registry, served, corrupted)
    config = fast_config(
        learning_rate=5e-4, epochs=2, prediction_percent=PERCENT, eval_max_regression=1.0
    )
    result = cycle_on_tasks(
        settings_for(vllm_server, tiny_model_dir, tmp_path), config, engine=clean_registry
    )
    assert result.status == TrainingRunStatus.published, result.reason

    with session_scope(clean_registry) as session:
        run = session.get_one(TrainingRun, result.run_id)
        prediction = run.prediction
        assert run.sample_count < len(served) * 0.7  # the slice was not trained on
        experiment_id = session.scalars(
            select(Arm.experiment_id)
            .join(Checkpoint, Checkpoint.id == Arm.checkpoint_id)
            .where(Checkpoint.name == result.checkpoint)
        ).one()
    assert prediction is not None and prediction["identity"]["passed"]
    estimate = prediction["kinds"]["all"]["mean_reward"]
    print(
        f"predicted mean reward {estimate['difference']:+.3f} "
        f"[{estimate['ci_low']:+.3f}, {estimate['ci_high']:+.3f}], "
        f"ESS {estimate['diagnostics']['effective_samples']:.0f} of {estimate['observations']}, "
        f"k̂ {estimate['diagnostics']['pareto_k']}"
    )
    # A conservative update on short answers keeps most of the effective samples (measured:
    # ESS 251 of 262, 231 of 250, and 155 of 262 once on a loaded machine, where the batches
    # trained differ with the traffic's timing; at lr 2e-3, clip 0.4 and four epochs, 20 of
    # 262). The
    # Pareto k̂ of ~250 weights is not as steady: two completions whose weight stands out
    # among many repeated answers decide the tail's fit (k̂ 0.19, 0.46, −0.13 and 1.35 in four
    # runs), so the estimate may be flagged for k̂ alone, never for its effective samples.
    diagnostics = estimate["diagnostics"]
    assert diagnostics["effective_fraction"] > 0.5, diagnostics
    assert all(reason.startswith("Pareto k̂") for reason in diagnostics["unreliable"])
    assert estimate["ci_high"] < 0
    assert prediction["kinds"]["all"]["kept"]["difference"] < 0
    assert set(prediction["kinds"]) == {"all", "one_turn"}  # no agent turn was logged

    # The canary: production's and the candidate's users, the candidate's kept less.
    realize_canary(clean_registry, experiment_id, result.checkpoint or "")
    scoreboard = asyncio.run(read_scoreboard(stack.postgres.url))
    record_ = next(r for r in scoreboard.records if r.training_run_id == result.run_id)
    assert record_.checkpoint == result.checkpoint and record_.experiment_id == experiment_id
    scored = {m.metric: m for m in record_.metrics}
    reward = scored["mean_reward"]
    assert reward.realized is not None and reward.realized < 0
    assert reward.sign_agrees and reward.error == pytest.approx(reward.predicted - reward.realized)
    assert reward.consistent is not None
    summary = {s.metric: s for s in scoreboard.scores}["mean_reward"]
    if estimate["reliable"]:
        assert summary.compared == 1 and summary.sign_agreement == 1.0
    else:  # scored, but left out of the shares that judge the screen
        assert summary.compared == 0 and summary.unreliable_share == 1.0


def realize_canary(engine: Engine, experiment_id: int, candidate: str) -> None:
    """What the canary served: 200 users an arm, the candidate's answers kept less often."""
    now = datetime.now(UTC) - timedelta(hours=1)
    samples, values = [], []
    for arm, checkpoint, kept_every in (("control", "base", 2), ("treatment", candidate, 3)):
        for n in range(1200):
            samples.append(
                {
                    "event_id": uuid4(),
                    "request_id": f"canary-{uuid4().hex}",
                    "session_id": "canary",
                    "user_hash": f"{arm}-{n % 200}",
                    "checkpoint": checkpoint,
                    "experiment_id": experiment_id,
                    "arm": arm,
                    "privacy": False,
                    "trainable": True,
                    "edit_requested": True,
                    "proposed_edit": True,
                    "status": "ok",
                    "ttft_ms": 1.0,
                    "latency_ms": 2.0,
                    "served_at": now,
                }
            )
            values.append(float(n % kept_every == 0))
    with engine.begin() as conn:
        ids = (
            conn.execute(insert(Sample).returning(Sample.id, sort_by_parameter_order=True), samples)
            .scalars()
            .all()
        )
    with session_scope(engine) as session:
        for sample_id, value in zip(ids, values, strict=True):
            session.add(final_reward(sample_id, value, now))
    refresh_rollups(engine)


async def read_scoreboard(database_url: str) -> Any:
    engine = make_async_engine(database_url)
    try:
        async with AsyncSession(engine) as session:
            return await prediction_scoreboard(session, 20)
    finally:
        await engine.dispose()
