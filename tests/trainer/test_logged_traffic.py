"""The logged-traffic evaluation gate: production's withheld traffic, kept against not kept."""

from __future__ import annotations

from pathlib import Path

import torch
from sqlalchemy import Engine, func, select

from app.db import session_scope
from app.models import Sample, TrainingRun, TrainingRunStatus
from app.serving.vllm import VllmServer
from rtrl.gates import held_out_for
from sandbox.task_family import TaskFamilyHeldOut
from tests.trainer.test_cycle import (
    Served,
    base_served,
    fast_config,
    record,
    registry,
    settings_for,
    solves,
)
from trainer.cycle import run_cycle
from trainer.logged_traffic import LoggedTrafficHeldOut, pairs_passed

__all__ = ["base_served", "registry"]  # fixtures shared with test_cycle


def test_pairs_passed_is_the_share_of_pairs_ranked_right() -> None:
    kept, rejected = torch.tensor([-0.1, -0.5]), torch.tensor([-0.3, -0.5, -0.9])
    # (-0.1 beats all three) + (-0.5 beats -0.9, ties -0.5, loses to -0.3) = 3 + 1.5 of 6
    assert pairs_passed(kept, rejected) == 4.5 / 6


def test_the_gate_is_chosen_by_the_setting(registry: Engine) -> None:
    assert isinstance(
        held_out_for(fast_config(eval_gate="task_family"), registry), TaskFamilyHeldOut
    )
    gate = held_out_for(fast_config(eval_gate="logged_traffic", eval_traffic_percent=20), registry)
    assert isinstance(gate, LoggedTrafficHeldOut) and gate.withheld_percent == 20


def test_a_cycle_scores_its_candidate_on_withheld_traffic_it_never_trained_on(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served, lambda task, done: float(solves(task, done)))
    config = fast_config(eval_gate="logged_traffic", eval_traffic_percent=30, eval_tasks=64)

    result = run_cycle(
        settings_for(vllm_server, tiny_model_dir, tmp_path),
        config,
        engine=registry,
        held_out=held_out_for(config, registry),
    )

    with session_scope(registry) as session:
        run = session.get_one(TrainingRun, result.run_id)
        trained_on = session.scalar(
            select(func.count()).select_from(Sample).where(Sample.id % 100 >= 30)
        )
        eval_results = run.eval_results
        sample_count = run.sample_count
    assert result.status == TrainingRunStatus.published, result.reason
    assert sample_count == trained_on < len(base_served)
    assert eval_results is not None and eval_results["gate"] == "logged_traffic"
    production, candidate = (
        eval_results["production_pass_rate"],
        eval_results["candidate_pass_rate"],
    )
    print(f"kept-over-not-kept pairs ranked right: production {production:.3f} -> {candidate:.3f}")
    assert candidate > production  # trained toward what was kept, on other samples


def test_too_little_withheld_traffic_skips_the_cycle(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    config = fast_config(min_samples=32, eval_gate="logged_traffic", eval_traffic_percent=5)
    result = run_cycle(
        settings_for(vllm_server, tiny_model_dir, tmp_path),
        config,
        engine=registry,
        held_out=held_out_for(config, registry),
    )
    assert result.status == TrainingRunStatus.skipped
    assert result.reason is not None and result.reason.startswith("logged-traffic gate: ")
