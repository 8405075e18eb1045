"""A cycle on agent runs vLLM served: the runs' turns trained as merged sequences, the drift
check passing on them as on single turns, and a run whose history was edited split there and
counted in the run's stats and the trainer's metrics."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from prometheus_client import REGISTRY
from sqlalchemy import Engine
from transformers import PreTrainedTokenizerFast

from app.config import Settings
from app.db import session_scope
from app.models import Reward, Sample, TrainingRun, TrainingRunStatus
from app.serving.sampling import ServedCompletion, sample_completions
from app.serving.vllm import VllmServer
from sandbox.task_family import task_family_held_out
from sandbox.tasks import train_tasks
from tests.trainer.conftest import KEPT
from trainer.config import TrainConfig
from trainer.cycle import run_cycle
from trainer.data import TrainingSample
from trainer.drift import measure_drift
from trainer.generation import prompt_ids
from trainer.policy import load_trainable_policy
from trainer.update import sharded_logprobs

RUNS, TURNS, EDITED_RUN, EDITED_TURN = 24, 3, 0, 2
Run = list[ServedCompletion]


@pytest.fixture(scope="module")
def served_runs(vllm_server: VllmServer, tiny_model_dir: Path) -> list[Run]:
    """Three-turn runs vLLM served: each turn's prompt is the last turn's prompt and answer,
    then a tool's result. Before its third turn one run's client edited its history."""
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    tool_result = tokenizer("\ntool: 3 tests passed\n", add_special_tokens=False).input_ids
    prompts = [prompt_ids(tokenizer, task.request) for task in train_tasks(seed=11, n=RUNS)]
    runs: list[Run] = [[] for _ in prompts]
    for turn in range(TURNS):
        if turn == EDITED_TURN:
            edited = prompts[EDITED_RUN]
            middle = len(edited) // 2
            prompts[EDITED_RUN] = [
                *edited[:middle],
                edited[middle] % 200 + 3,
                *edited[middle + 1 :],
            ]
        served = sample_completions(vllm_server.url, "base", prompts, max_tokens=24)
        for run, completion in zip(runs, served, strict=True):
            run.append(completion)
        prompts = [
            [*done.prompt_token_ids, *done.completion_token_ids, *tool_result] for done in served
        ]
    return runs


def record_runs(engine: Engine, runs: list[Run]) -> list[TrainingSample]:
    """Store the runs' turns as the base's samples with final rewards; the samples."""
    rng = random.Random(0)
    now = datetime.now(UTC)  # after the base was registered: served by it
    stored = []
    with session_scope(engine) as session:
        for number, run in enumerate(runs):
            trajectory = f"run-{uuid4().hex}"
            for turn, completion in enumerate(run):
                served_at = now + timedelta(milliseconds=10 * number + turn)
                row = Sample(
                    event_id=uuid4(),
                    request_id=trajectory if turn == 0 else f"req-{uuid4().hex}",
                    session_id="layout-test",
                    user_hash="u",
                    checkpoint="base",
                    privacy=False,
                    trainable=True,
                    edit_requested=True,
                    proposed_edit=turn == len(run) - 1,
                    tools_declared=True,
                    trajectory_id=trajectory,
                    turn_index=turn,
                    prompt_token_ids=completion.prompt_token_ids,
                    completion_token_ids=completion.completion_token_ids,
                    behaviour_logprobs=completion.logprobs,
                    status="ok",
                    ttft_ms=1.0,
                    latency_ms=2.0,
                    served_at=served_at,
                )
                session.add(row)
                session.flush()
                reward = float(rng.random() < 0.5)
                session.add(
                    Reward(
                        sample_id=row.id,
                        components=KEPT.model_dump(mode="json"),
                        reward=reward,
                        reward_version=1,
                        due_at=now,
                        finalized_at=now,
                        finalize_reason="horizon",
                    )
                )
                stored.append(
                    TrainingSample(
                        sample_id=row.id,
                        prompt_token_ids=completion.prompt_token_ids,
                        completion_token_ids=completion.completion_token_ids,
                        behaviour_logprobs=completion.logprobs,
                        reward=reward,
                        served_at=served_at,
                        tools_declared=True,
                        turn_index=turn,
                        edit_requested=True,
                        trajectory_id=trajectory,
                    )
                )
    return stored


def merge_breaks() -> float:
    return REGISTRY.get_sample_value("rtrl_training_merge_breaks_total") or 0.0


def test_a_cycle_trains_agent_runs_as_merged_sequences_and_counts_an_edited_history(
    clean_registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    served_runs: list[Run],
    tmp_path: Path,
) -> None:
    samples = record_runs(clean_registry, served_runs)
    config = TrainConfig(
        min_samples=64,
        epochs=2,
        learning_rate=1e-3,
        eval_tasks=32,
        eval_max_regression=0.25,
        eval_max_kl=5.0,
        threads=1,
        prediction_percent=0,
        target_kl=None,  # every epoch runs: the tokens fed are counted per epoch below
    )
    assert config.layout == "merged"  # the default
    settings = Settings(data_dir=tmp_path, vllm_urls=[vllm_server.url], base_model=tiny_model_dir)
    breaks_before = merge_breaks()

    result = run_cycle(
        settings, config, engine=clean_registry, held_out=task_family_held_out(config)
    )

    assert result.status == TrainingRunStatus.published, result.reason
    with session_scope(clean_registry) as session:
        stats = session.get_one(TrainingRun, result.run_id).stats
    assert stats is not None
    # Every run one row, the edited one two; every sampled token trained.
    assert (stats["layout"], stats["rows"], stats["merge_breaks"]) == ("merged", RUNS + 1, 1)
    assert stats["tokens"] == config.epochs * sum(len(s.completion_token_ids) for s in samples)
    stepwise_fed = sum(len(s.prompt_token_ids) + len(s.completion_token_ids) for s in samples)
    assert stats["tokens_fed"] < 0.6 * config.epochs * stepwise_fed
    assert merge_breaks() == breaks_before + 1

    # The drift check saw vLLM's logprobs as each turn alone shows them.
    stepwise = TrainConfig(layout="stepwise", device="cpu")
    policy = load_trainable_policy(tiny_model_dir, None, stepwise, torch.device("cpu"))
    alone = measure_drift(
        [s.behaviour_logprobs for s in samples],
        sharded_logprobs(policy, samples, stepwise),
        tis_cap=config.tis_cap,
    )
    assert stats["drift_tokens"] == alone.tokens
    assert stats["drift_mean_abs"] == pytest.approx(alone.mean_abs, rel=0.01, abs=1e-7)
    # The largest difference is float32 rounding (about 1e-5 here) and moves with the order of
    # the sums (7.2e-6 against 5.6e-6 once, on a loaded machine); logprobs taken at the wrong
    # positions would differ by tenths.
    assert stats["drift_max_abs"] == pytest.approx(alone.max_abs, rel=0.05, abs=2e-5)
    assert stats["drift_max_abs"] < 1e-3
