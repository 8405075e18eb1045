"""`rtrl train --once` under `torchrun --nproc-per-node 2` (gloo, CPU) makes the update one
process makes, on the same samples with the same seed; `rtrl trainer` under torchrun trains
a requested cycle on both ranks and stops on SIGTERM."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import Engine, select

from app.config import settings_environment
from app.db import session_scope
from app.models import Checkpoint, CycleTrigger, TrainingRun, TrainingRunStatus
from app.registry.audit import Actor
from app.registry.flags import request_training_cycle
from app.serving.vllm import VllmServer
from rtrl.gates import held_out_for
from tests.trainer.test_cycle import Served, base_served, record, registry, settings_for, solves
from trainer.config import train_config_from_env
from trainer.cycle import run_cycle

__all__ = ["base_served", "registry"]  # fixtures shared with test_cycle

TRAIN_ENV = {
    "RTRL_TRAIN_MIN_SAMPLES": "64",
    "RTRL_TRAIN_MIN_NEW_SAMPLES": "0",  # the second run trains on the first one's window
    "RTRL_TRAIN_EPOCHS": "2",
    "RTRL_TRAIN_LEARNING_RATE": "2e-3",
    # 3 steps per epoch (24 + 24 + 16 samples): each rank trains on 12, 12 and 8 of them.
    "RTRL_TRAIN_MINIBATCH_SIZE": "24",
    "RTRL_TRAIN_MICRO_BATCH_TOKENS": "512",
    "RTRL_TRAIN_EVAL_TASKS": "8",
    "RTRL_TRAIN_EVAL_MAX_REGRESSION": "1",
    "RTRL_TRAIN_EVAL_MAX_KL": "100",
    "RTRL_TRAIN_THREADS": "1",
    "RTRL_TRAIN_PREDICTION_PERCENT": "0",  # every sample trains
}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TOLERANCE = 0.01
"""Max ‖Δ‖ between the two runs' LoRA weights, as a share of ‖B‖ (B starts at 0, so ‖B‖ is
how far the update moved it), Frobenius norms over every tensor. Float sums in another order
(micro-batches, the all-reduce) differ in the last bits, and Adam turns that into up to a
whole step (2e-3) on a weight whose gradient is near 0, where the sign of the noise decides
the step's sign: the largest single |Δ| measured 1.6e-5 in one run and 1.9e-4 in another, so
a bound on it fails by chance. Over all the tensors that noise measured 0.004% of ‖B‖;
a rank's gradient lost, or a rank training on the other's samples, changes the update's
direction, a large share of ‖B‖."""


def lora_weights(engine: Engine, run_id: int) -> dict[str, torch.Tensor]:
    with session_scope(engine) as session:
        run = session.get_one(TrainingRun, run_id)
        assert run.status == TrainingRunStatus.published, run.reason
        checkpoint = session.scalars(
            select(Checkpoint).where(Checkpoint.id == run.output_checkpoint_id)
        ).one()
        path = Path(str(checkpoint.adapter_path)) / "adapter_model.safetensors"
    return load_file(str(path))


def norm(tensors: Iterable[torch.Tensor]) -> float:
    """The Frobenius norm of tensors taken together."""
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def test_two_ranks_make_the_update_one_rank_makes(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    settings = settings_for(vllm_server, tiny_model_dir, tmp_path)
    for name, value in TRAIN_ENV.items():
        monkeypatch.setenv(name, value)
    config = train_config_from_env()
    one = run_cycle(
        settings,
        config,
        engine=registry,
        held_out=held_out_for(config, registry, settings.base_model_path),
    )

    command = [*TORCHRUN, "-m", "rtrl.cli", "train", "--once"]
    environment = {**os.environ, **settings_environment(settings), **TRAIN_ENV}
    environment["OMP_NUM_THREADS"] = "1"
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    assert "published ckpt-" in finished.stdout

    with session_scope(registry) as session:
        two = session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc())).first()
        assert two is not None and two.id != one.run_id and two.stats is not None
        assert two.stats["ranks"] == 2 and two.sample_count == 64
        two_id = two.id
    single, double = lora_weights(registry, one.run_id), lora_weights(registry, two_id)
    assert single.keys() == double.keys()
    moved = norm(t for name, t in single.items() if "lora_B" in name)
    difference = norm(single[name] - double[name] for name in single)
    largest = max(float((single[name] - double[name]).abs().max()) for name in single)
    print(
        f"1 rank vs 2 ranks: ‖Δ LoRA‖ {difference:.2e} = {difference / moved:.1e} of ‖B‖"
        f" {moved:.2e}; largest |Δ| {largest:.2e}"
    )
    assert moved > 1e-2
    assert difference <= TOLERANCE * moved


@pytest.mark.scenario
def test_the_trainer_under_torchrun_trains_a_requested_cycle_on_two_ranks_and_stops(
    registry: Engine,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    base_served: Served,
    tmp_path: Path,
) -> None:
    record(registry, base_served[:64], lambda task, done: float(solves(task, done)))
    settings = settings_for(vllm_server, tiny_model_dir, tmp_path).model_copy(
        update={"train_interval": timedelta(hours=1)}
    )
    with session_scope(registry) as session:
        request_training_cycle(session, Actor("ops"))
    environment = {**os.environ, **settings_environment(settings), **TRAIN_ENV}
    environment["OMP_NUM_THREADS"] = "1"
    log = tmp_path / "trainer.log"
    with log.open("w") as output:
        trainer = subprocess.Popen(
            [*TORCHRUN, "-m", "rtrl.cli", "trainer"],
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 240
        while (run := requested_run(registry)) is None:
            assert trainer.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert run.status == TrainingRunStatus.published, run.reason
        assert run.stats is not None and run.stats["ranks"] == 2

        os.killpg(trainer.pid, signal.SIGTERM)  # as `docker stop` does: every process
        trainer.wait(timeout=60)
        assert "cycle finished" in log.read_text()
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
            trainer.wait()


def requested_run(engine: Engine) -> TrainingRun | None:
    """The run an ops request started, once it has finished."""
    with session_scope(engine) as session:
        run = session.scalars(
            select(TrainingRun).where(
                TrainingRun.trigger == CycleTrigger.request, TrainingRun.finished_at.is_not(None)
            )
        ).first()
        if run is not None:
            session.expunge(run)
        return run
