"""Guardrails: a harmful canary is rolled back (audited as "guardrails"), by ops or by the
workers on their own, a harmless one is left alone, and checking as often as we like does not
inflate false alarms."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
import pytest
import statsmodels.api as sm
from prometheus_client import REGISTRY
from scipy import stats
from sqlalchemy import Engine, select

from app.abtest.guardrails import FAMILY_ALPHA, GUARDRAILS, check_guardrails, confidence_sequence
from app.config import Settings
from app.db import session_scope
from app.models import AuditEntry, Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from rtrl.embedded.stack import EmbeddedStack
from tests.analytics.conftest import Behaviour, SeededArm
from tests.conftest import fresh_worker_config
from workers.consumer import run_worker

Seeder = Callable[..., tuple[int, pd.DataFrame]]


def test_a_canary_with_more_dissatisfied_users_is_rolled_back(
    seeder: Seeder, app_engine: Engine
) -> None:
    harmful, _ = seeder(
        [
            SeededArm("control", "gr-base", 5_000, Behaviour(users=300), is_control=True),
            SeededArm("canary", "gr-bad", 5_000, Behaviour(users=300, dissatisfied=0.3)),
        ],
        seed=31,
    )
    harmless, _ = seeder(
        [
            SeededArm("control", "gr-base-2", 5_000, Behaviour(users=300), is_control=True),
            SeededArm("canary", "gr-fine", 5_000, Behaviour(users=300)),
        ],
        seed=32,
    )

    rollbacks = REGISTRY.get_sample_value("rtrl_guardrail_rollbacks_total")
    decisions = check_guardrails(app_engine, rollback=True)

    # Ops' alert: the counter rises once per canary rolled back, not once per guardrail.
    rolled_back = {(d.experiment_id, d.arm) for d in decisions if d.rolled_back}
    assert (harmful, "canary") in rolled_back
    assert REGISTRY.get_sample_value("rtrl_guardrail_rollbacks_total") == rollbacks + len(
        rolled_back
    )
    mine = {
        (d.experiment_id, d.metric): d for d in decisions if d.experiment_id in (harmful, harmless)
    }
    assert len(mine) == 2 * len(GUARDRAILS)
    verdict = mine[(harmful, "dissatisfied_rate")]
    assert verdict.harmful and verdict.rolled_back
    assert verdict.ci_low is not None and verdict.ci_high is not None
    assert 0 < verdict.ci_low < verdict.difference < verdict.ci_high  # type: ignore[operator]
    assert verdict.alpha == pytest.approx(FAMILY_ALPHA / len(GUARDRAILS))
    assert not any(d.harmful or d.rolled_back for (e, _), d in mine.items() if e == harmless)
    with session_scope(app_engine) as session:
        status = {c.name: c.status for c in session.scalars(select(Checkpoint))}
        assert status["gr-bad"] == CheckpointStatus.rolled_back
        assert status["gr-fine"] == CheckpointStatus.canary
        experiments = {e.id: e.status for e in session.scalars(select(Experiment))}
        assert experiments[harmful] == ExperimentStatus.stopped
        assert experiments[harmless] == ExperimentStatus.running
        entry = session.scalar(select(AuditEntry).where(AuditEntry.target == "checkpoint:gr-bad"))
        assert entry is not None and entry.actor == "guardrails" and entry.actor_key_id is None
        assert entry.before == {"checkpoint": {"name": "gr-bad", "status": "canary"}}
        assert entry.after is not None and "dissatisfied_rate" in entry.after["reason"]


def test_workers_with_a_guardrail_interval_roll_back_a_harmful_canary_on_their_own(
    seeder: Seeder, app_engine: Engine, app_settings: Settings, stack: EmbeddedStack
) -> None:
    harmful, _ = seeder(
        [
            SeededArm("control", "gw-base", 5_000, Behaviour(users=300), is_control=True),
            SeededArm("canary", "gw-slow", 5_000, Behaviour(users=300, latency_median_ms=900.0)),
        ],
        seed=33,
    )
    config = fresh_worker_config(stack.kafka.url, guardrail_interval_s=0.5)
    stop = threading.Event()
    worker = threading.Thread(
        target=run_worker, args=(app_settings,), kwargs={"stop_event": stop, "config": config}
    )
    worker.start()

    def status() -> CheckpointStatus:
        with session_scope(app_engine) as session:
            checkpoint = session.scalar(select(Checkpoint).where(Checkpoint.name == "gw-slow"))
            assert checkpoint is not None
            return checkpoint.status

    try:
        deadline = time.monotonic() + 60
        while status() == CheckpointStatus.canary and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        stop.set()
        worker.join(timeout=30)

    assert status() == CheckpointStatus.rolled_back
    with session_scope(app_engine) as session:
        assert session.get(Experiment, harmful).status == ExperimentStatus.stopped  # type: ignore[union-attr]
        entry = session.scalar(select(AuditEntry).where(AuditEntry.target == "checkpoint:gw-slow"))
        assert entry is not None and entry.actor == "guardrails"
        assert "latency_mean_ms" in entry.after["reason"]  # type: ignore[index]


def test_the_confidence_sequence_is_where_the_mixture_likelihood_ratio_reaches_one_over_alpha() -> (
    None
):
    difference, variance, tau, alpha = 0.0, 4e-4, 0.02, 0.0125
    low, high = confidence_sequence(difference, variance, tau, alpha)
    boundary = high - difference
    log_ratio = 0.5 * math.log(variance / (variance + tau**2)) + tau**2 * boundary**2 / (
        2 * variance * (variance + tau**2)
    )
    assert log_ratio == pytest.approx(math.log(1 / alpha))
    assert low == pytest.approx(-high)


def test_checking_after_every_batch_keeps_false_alarms_below_alpha() -> None:
    """Peeking 40 times at an A/A test: the fixed 95% z-interval cries wolf far more than 5%
    of the time, the always-valid sequence stays under its alpha."""
    rng = np.random.default_rng(7)
    runs, batches, batch, rate, alpha, tau = 400, 40, 250, 0.1, 0.05, 0.02
    naive_alarms = sequential_alarms = 0
    for _ in range(runs):
        a = rng.binomial(batch, rate, batches).cumsum()
        b = rng.binomial(batch, rate, batches).cumsum()
        n = batch * np.arange(1, batches + 1)
        pa, pb = a / n, b / n
        variance = pa * (1 - pa) / n + pb * (1 - pb) / n
        z = np.abs(pa - pb) / np.sqrt(variance)
        naive_alarms += bool((z > stats.norm.ppf(0.975)).any())
        sequential_alarms += any(
            not (low <= 0 <= high)
            for low, high in (
                confidence_sequence(d, v, tau, alpha)
                for d, v in zip(pa - pb, variance, strict=True)
            )
        )
    assert naive_alarms / runs > 2 * alpha
    assert sequential_alarms / runs <= alpha


def test_the_sequence_uses_the_variance_over_users(seeder: Seeder, app_engine: Engine) -> None:
    """The mSPRT's variance is the delta method's over users, as statsmodels clusters it."""
    experiment_id, rows = seeder(
        [
            SeededArm(
                "control",
                "gu-base",
                5_000,
                Behaviour(users=200, requests_per_user=3, most_requests_per_user=30),
                is_control=True,
            ),
            SeededArm(
                "canary",
                "gu-new",
                5_000,
                Behaviour(users=200, requests_per_user=3, most_requests_per_user=30),
            ),
        ],
        seed=34,
    )

    decisions = check_guardrails(app_engine, rollback=False)

    verdict = next(
        d for d in decisions if d.experiment_id == experiment_id and d.metric == "latency_mean_ms"
    )
    variance = 0.0
    for arm in ("canary", "control"):
        frame = rows[rows.arm == arm]
        fit = sm.OLS(frame.latency_ms.to_numpy(), np.ones(len(frame))).fit(
            cov_type="cluster", cov_kwds={"groups": pd.factorize(frame.user_hash)[0]}
        )
        variance += float(fit.cov_params()[0, 0])
    guardrail = next(g for g in GUARDRAILS if g.metric == "latency_mean_ms")
    low, high = confidence_sequence(
        verdict.difference or 0.0, variance, guardrail.tau, verdict.alpha
    )
    assert (verdict.ci_low, verdict.ci_high) == (pytest.approx(low), pytest.approx(high))
    assert (verdict.canary_users, verdict.control_users) == (200, 200)
