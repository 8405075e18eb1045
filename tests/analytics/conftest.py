"""Analytics tests: the app on its own database, and experiments seeded with known effects."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import pandas as pd
import pytest
from scipy import stats
from sqlalchemy import Engine, insert, select

from app.db import session_scope
from app.models import (
    Arm,
    Checkpoint,
    CheckpointStatus,
    Experiment,
    ExperimentStatus,
    Reward,
    Role,
    Sample,
)
from tests.analytics import app_fixtures

# The app on a database of its own (see app_fixtures.py).
app_database = app_fixtures.app_database
app_engine = app_fixtures.app_engine
app_settings = app_fixtures.app_settings
client = app_fixtures.client
make_key = app_fixtures.make_key

LATENCY_BUDGET_MS = 2000.0
DAYS = 3


@dataclass(frozen=True)
class Behaviour:
    """How an arm's users fare: the true rates the seeded samples are drawn with."""

    users: int
    requests_per_user: int = 8
    most_requests_per_user: int | None = None
    """With a value: each user makes between `requests_per_user` and this many requests."""
    accept: float = 0.4
    accept_concentration: float | None = None
    """With a value: each user accepts at their own rate, Beta(accept c, (1 - accept) c)."""
    pre_requests_per_user: int = 0
    """Requests each user made in the week before the experiment (no experiment, no arm)."""
    pre_accept: float = 0.4
    """The mean acceptance rate before the experiment: a user keeps their rank among users."""
    dissatisfied: float = 0.1
    malformed: float = 0.05
    error: float = 0.01
    latency_median_ms: float = 600.0


@dataclass(frozen=True)
class SeededArm:
    name: str
    checkpoint: str
    weight_bps: int
    behaviour: Behaviour
    is_control: bool = False
    checkpoint_status: CheckpointStatus = CheckpointStatus.canary


def day_zero() -> datetime:
    """Midnight UTC, DAYS days ago: the seeded samples fill [day_zero, day_zero + DAYS)."""
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today - timedelta(days=DAYS + 1)


def seed_experiment(
    engine: Engine, arms: list[SeededArm], seed: int = 1
) -> tuple[int, pd.DataFrame]:
    """An experiment with checkpoints, samples and final rewards; its id and the raw rows."""
    rng = np.random.default_rng(seed)
    with session_scope(engine) as session:
        ids = {}
        for arm in arms:
            found = session.scalar(select(Checkpoint).where(Checkpoint.name == arm.checkpoint))
            if found is None:
                found = Checkpoint(
                    name=arm.checkpoint, status=arm.checkpoint_status, base_model="tiny-base"
                )
                session.add(found)
                session.flush()
            ids[arm.name] = found.id
        experiment = Experiment(
            name=f"seeded-{uuid.uuid4().hex[:8]}",
            route=f"route-{uuid.uuid4().hex[:8]}",
            salt="seeded",
            status=ExperimentStatus.running,
            started_at=day_zero(),
            arms=[
                Arm(
                    name=arm.name,
                    checkpoint_id=ids[arm.name],
                    weight_bps=arm.weight_bps,
                    is_control=arm.is_control,
                )
                for arm in arms
            ],
        )
        session.add(experiment)
        session.flush()
        experiment_id = experiment.id
    frames = [_arm_rows(rng, experiment_id, arm) for arm in arms]
    rows = pd.concat(frames, ignore_index=True)
    _insert(engine, rows)
    return experiment_id, rows


def _arm_rows(rng: np.random.Generator, experiment_id: int, arm: SeededArm) -> pd.DataFrame:
    b = arm.behaviour
    most = b.most_requests_per_user or b.requests_per_user
    counts = rng.integers(b.requests_per_user, most + 1, b.users)
    names = [f"{experiment_id}-{arm.name}-{u}" for u in range(b.users)]
    propensity = pre_propensity = np.full(b.users, b.accept)
    if b.accept_concentration is not None:
        c, rank = b.accept_concentration, rng.random(b.users)
        propensity = stats.beta.ppf(rank, b.accept * c, (1 - b.accept) * c)
        pre_propensity = stats.beta.ppf(rank, b.pre_accept * c, (1 - b.pre_accept) * c)
    frame = _rows(rng, np.repeat(names, counts), np.repeat(propensity, counts), b, DAYS * 86_400)
    frame["arm"], frame["checkpoint"] = arm.name, arm.checkpoint
    frame["experiment_id"] = experiment_id
    frame["served_at"] = [day_zero() + timedelta(seconds=float(s)) for s in frame.offset_s]
    if not b.pre_requests_per_user:
        return frame
    pre_users = np.repeat(names, b.pre_requests_per_user)
    pre = _rows(rng, pre_users, np.repeat(pre_propensity, b.pre_requests_per_user), b, 7 * 86_400)
    pre["arm"], pre["checkpoint"], pre["experiment_id"] = None, f"{arm.checkpoint}-pre", None
    pre["served_at"] = [
        day_zero() - timedelta(days=7) + timedelta(seconds=float(s)) for s in pre.offset_s
    ]
    return pd.concat([frame, pre], ignore_index=True)


def _rows(
    rng: np.random.Generator,
    users: np.ndarray,
    propensity: np.ndarray,
    b: Behaviour,
    span_s: float,
) -> pd.DataFrame:
    n = len(users)
    accepted = rng.random(n) < propensity
    kept = np.where(accepted, rng.beta(4, 2, n), 0.0)
    followed_up = rng.random(n) < 0.5
    dissatisfied = np.where(followed_up, rng.random(n) < b.dissatisfied, None)
    tool_calls = (rng.random(n) < 0.3).astype(int)
    malformed = tool_calls * (rng.random(n) < b.malformed)
    errors = rng.random(n) < b.error
    latency = rng.lognormal(np.log(b.latency_median_ms), 0.5, n)
    reward = kept - 0.5 * (dissatisfied == True) - 0.2 * (latency > LATENCY_BUDGET_MS)  # noqa: E712
    return pd.DataFrame(
        {
            "user_hash": users,
            "accepted": accepted,
            "kept": kept,
            "dissatisfied": dissatisfied,
            "tool_calls": tool_calls,
            "malformed_tool_calls": malformed,
            "status": np.where(errors, "error", "ok"),
            "latency_ms": latency,
            "offset_s": rng.uniform(0, span_s, n),
            "reward": reward,
        }
    )


def _insert(engine: Engine, rows: pd.DataFrame) -> None:
    samples, rewards = [], []
    for row in rows.itertuples():
        request_id = f"r-{uuid.uuid4().hex}"
        samples.append(
            {
                "event_id": uuid.uuid4(),
                "request_id": request_id,
                "session_id": f"s-{row.user_hash}",
                "user_hash": row.user_hash,
                "checkpoint": row.checkpoint,
                "experiment_id": None if pd.isna(row.experiment_id) else int(row.experiment_id),
                "arm": row.arm,
                "privacy": False,
                "trainable": True,
                "edit_requested": True,
                "proposed_edit": True,
                "status": row.status,
                "ttft_ms": row.latency_ms / 4,
                "latency_ms": row.latency_ms,
                "tool_calls": row.tool_calls,
                "malformed_tool_calls": row.malformed_tool_calls,
                "served_at": row.served_at,
            }
        )
    with engine.begin() as conn:
        ids = (
            conn.execute(insert(Sample).returning(Sample.id, sort_by_parameter_order=True), samples)
            .scalars()
            .all()
        )
        for sample_id, row in zip(ids, rows.itertuples(), strict=True):
            rewards.append(
                {
                    "sample_id": sample_id,
                    "components": {
                        "edit_requested": True,
                        "proposed_edit": True,
                        "accepted": bool(row.accepted),
                        "kept": float(row.kept),
                        "survival_elapsed_s": 900.0,
                        "dissatisfied": row.dissatisfied,
                        "latency_ms": float(row.latency_ms),
                        "latency_over_budget": bool(row.latency_ms > LATENCY_BUDGET_MS),
                        "malformed_tool_calls": int(row.malformed_tool_calls),
                        "status": row.status,
                    },
                    "reward": float(row.reward),
                    "reward_version": 1,
                    "due_at": row.served_at,
                    "finalized_at": row.served_at + timedelta(minutes=20),
                    "finalize_reason": "horizon",
                }
            )
        conn.execute(insert(Reward), rewards)


@pytest.fixture(scope="session")
def seeder(app_engine: Engine) -> Callable[..., tuple[int, pd.DataFrame]]:
    def seed(arms: list[SeededArm], seed: int = 1) -> tuple[int, pd.DataFrame]:
        return seed_experiment(app_engine, arms, seed)

    return seed


@pytest.fixture
def analyst_headers(make_key: Callable[..., str]) -> dict[str, Any]:
    return app_fixtures.bearer(make_key(Role.analyst))
