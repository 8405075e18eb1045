"""What the trainer tests share: stored samples with their rewards, and `rtrl trainer`
processes on the session's services."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Protocol
from uuid import uuid4

import pytest
from sqlalchemy import Engine, delete, select

from app.config import Settings, settings_environment
from app.db import session_scope
from app.models import ControlFlag, Reward, Sample, TrainingRun, TrainingSchedule
from app.registry.schedule import next_cycle_at
from app.signals.rewards import RewardComponents
from rtrl.embedded.stack import EmbeddedStack
from rtrl.launcher import RtrlProcess

KEPT = RewardComponents(
    edit_requested=True,
    proposed_edit=True,
    accepted=True,
    kept=1.0,
    survival_elapsed_s=900.0,
    dissatisfied=None,
    latency_ms=2.0,
    latency_over_budget=False,
    malformed_tool_calls=0,
    status="ok",
)
"""What a stored reward of these samples is made of: an edit kept whole."""


def store_samples(
    engine: Engine,
    count: int,
    *,
    served_at: datetime | None = None,
    tokens: list[tuple[list[int], list[int], list[float]]] | None = None,
) -> None:
    """Finalized, trainable samples of `base`: synthetic tokens unless `tokens` are given."""
    tokens = tokens or [([1, 2, 3], [4, 5], [-1.0, -1.0])] * count
    now = datetime.now(UTC)
    with session_scope(engine) as session:
        for prompt, completion, logprobs in tokens:
            row = Sample(
                event_id=uuid4(),
                request_id=f"req-{uuid4().hex}",
                session_id="scheduler-test",
                user_hash="u",
                checkpoint="base",
                privacy=False,
                trainable=True,
                edit_requested=True,
                proposed_edit=True,
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                behaviour_logprobs=logprobs,
                status="ok",
                ttft_ms=1.0,
                latency_ms=2.0,
                served_at=served_at or now,
            )
            session.add(row)
            session.flush()
            session.add(
                Reward(
                    sample_id=row.id,
                    components=KEPT.model_dump(mode="json"),
                    reward=1.0,
                    reward_version=1,
                    due_at=now,
                    finalized_at=now,
                    finalize_reason="horizon",
                )
            )


def trainer_settings(
    stack: EmbeddedStack, model_dir: Path, data_dir: Path, vllm_url: str, interval: timedelta
) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=f"postgresql+psycopg://postgres@localhost:{stack.postgres.port}/rtrl",
        kafka_bootstrap_servers=f"localhost:{stack.kafka.port}",
        redis_url=f"redis://localhost:{stack.redis.port}/0",
        base_model=model_dir,
        vllm_urls=[vllm_url],
        train_interval=interval,
    )


class StartTrainers(Protocol):
    def __call__(self, count: int, settings: Settings, **train: object) -> list[RtrlProcess]:
        """Start `count` trainers on `settings`; `train` sets `RTRL_TRAIN_<NAME>` for them."""
        ...


@pytest.fixture
def start_trainers(tmp_path: Path) -> Iterator[StartTrainers]:
    """Starts `rtrl trainer` processes; stops them after the test."""
    started: list[RtrlProcess] = []

    def start(count: int, settings: Settings, **train: object) -> list[RtrlProcess]:
        environment = settings_environment(settings)
        train = {"prediction_percent": 0} | train  # every stored sample trains
        environment |= {f"RTRL_TRAIN_{name.upper()}": str(value) for name, value in train.items()}
        for _ in range(count):
            name = f"trainer-{len(started) + 1}"
            trainer = RtrlProcess(
                name, ["trainer"], tmp_path / "run", tmp_path / "logs", environment
            )
            trainer.start()
            started.append(trainer)
        return started

    yield start
    for trainer in started:
        trainer.stop()


def wait_until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


def first_due(engine: Engine, trainers: list[RtrlProcess]) -> datetime:
    """The first due time, once a trainer has scheduled it."""

    def due() -> datetime | None:
        with session_scope(engine) as session:
            return next_cycle_at(session)

    wait_until(due, 120, "a trainer schedules the first cycle")
    for trainer in trainers:
        assert trainer.pid() is not None, trainer.log_file.read_text()[-2000:]
    found = due()
    assert found is not None
    return found


def sleep_until(moment: datetime) -> None:
    time.sleep(max(0.0, (moment - datetime.now(UTC)).total_seconds()))


def runs(engine: Engine) -> list[TrainingRun]:
    with session_scope(engine) as session:
        return list(session.scalars(select(TrainingRun).order_by(TrainingRun.id)))


@pytest.fixture
def registry(clean_registry: Engine) -> Engine:
    """The registry with no training schedule and no control flags set."""
    with session_scope(clean_registry) as session:
        session.execute(delete(TrainingSchedule))
        session.execute(delete(ControlFlag))
    return clean_registry
