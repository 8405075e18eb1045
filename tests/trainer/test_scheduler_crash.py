"""A trainer killed mid-cycle, as a real process: the next due cycle is taken by another
trainer on time. A module of its own (it needs the base model's weights, to train), so the
rest of the cadence tests run while the session's base model trains."""

from __future__ import annotations

import os
import signal
import socket
import time
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from transformers import PreTrainedTokenizerFast

from app.db import session_scope
from app.models import CycleTrigger, TrainingRunStatus
from app.serving.sampling import sample_completions
from app.serving.vllm import VllmServer
from rtrl.embedded.stack import EmbeddedStack
from sandbox.tasks import train_tasks
from tests.trainer.conftest import (
    StartTrainers,
    first_due,
    runs,
    store_samples,
    trainer_settings,
    wait_until,
)
from trainer.generation import prompt_ids


@pytest.mark.scenario
@pytest.mark.slow
def test_a_trainer_killed_mid_cycle_does_not_stall_the_schedule(
    registry: Engine,
    stack: EmbeddedStack,
    vllm_server: VllmServer,
    tiny_model_dir: Path,
    tmp_path: Path,
    start_trainers: StartTrainers,
) -> None:
    # Enough real samples that the first due cycle trains, for 100 passes over them: longer
    # than the test waits on any machine (the default 2 passes were over in 1 s on a fast one).
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model_dir)
    prompts = [prompt_ids(tokenizer, task.request) for task in train_tasks(seed=5, n=80)]
    served = sample_completions(vllm_server.url, "base", prompts, max_tokens=48)
    store_samples(
        registry,
        len(served),
        tokens=[(s.prompt_token_ids, s.completion_token_ids, s.logprobs) for s in served],
    )
    interval = timedelta(seconds=15)
    settings = trainer_settings(stack, tiny_model_dir, tmp_path, vllm_server.url, interval)
    trainers = start_trainers(3, settings, epochs=100)
    due = first_due(registry, trainers)

    wait_until(lambda: runs(registry), 60, "a trainer takes the first due cycle")
    time.sleep(1.0)
    (crashed,) = runs(registry)
    assert crashed.status == TrainingRunStatus.running  # mid-cycle
    killed = next(t for t in trainers if crashed.trainer == f"{socket.gethostname()}:{t.pid()}")
    os.kill(killed.pid() or 0, signal.SIGKILL)
    wait_until(lambda: killed.pid() is None, 10, "the killed trainer is gone")
    assert runs(registry)[0].status == TrainingRunStatus.running
    with session_scope(registry) as session:  # the next cycle has nothing to train on
        session.execute(text("UPDATE samples SET trainable = false"))

    wait_until(lambda: len(runs(registry)) == 2 and runs(registry)[1].finished_at, 60, "next run")
    crashed, taken = runs(registry)
    assert crashed.status == TrainingRunStatus.failed and "died" in (crashed.reason or "")
    assert taken.trigger == CycleTrigger.schedule and taken.trainer != crashed.trainer
    assert due + interval <= taken.started_at < due + interval + timedelta(seconds=10)
    assert taken.status == TrainingRunStatus.skipped
