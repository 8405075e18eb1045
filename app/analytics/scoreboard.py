"""The scoreboard: each candidate's A/B predicted before its canary, against what its canary
realized, per metric, and how often the two agreed."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from app.abtest.stats import CONFIDENCE
from app.analytics.schemas import (
    ExperimentResults,
    PredictedMetric,
    PredictionRecord,
    PredictionScore,
    PredictionScoreboard,
    VsControl,
    Window,
)
from app.analytics.service import experiment_results
from app.models import Arm, Checkpoint, Experiment, TrainingRun

_Z = 1.959963984540054  # the two-sided 95% normal quantile, as CONFIDENCE


async def prediction_scoreboard(session: AsyncSession, limit: int) -> PredictionScoreboard:
    """The latest `limit` predictions, each with its canary's realized differences."""
    runs = (
        await session.scalars(
            select(TrainingRun)
            .where(TrainingRun.prediction.is_not(None))
            .order_by(TrainingRun.id.desc())
            .limit(limit)
        )
    ).all()
    records = []
    for run in runs:
        checkpoint = await _name(session, run.output_checkpoint_id)
        experiment_id = await _canary_of(session, run.output_checkpoint_id)
        realized = (
            await experiment_results(session, experiment_id, Window())
            if experiment_id is not None
            else None
        )
        prediction: dict[str, Any] = run.prediction or {}
        records.append(
            PredictionRecord(
                training_run_id=run.id,
                checkpoint=checkpoint,
                status=run.status.value,
                experiment_id=experiment_id,
                predicted_at=run.finished_at,
                samples=int(prediction.get("samples", 0)),
                identity_passed=bool(prediction.get("identity", {}).get("passed")),
                metrics=[
                    scored(metric, estimate, _treatment_vs_control(realized, metric))
                    for metric, estimate in prediction.get("kinds", {}).get("all", {}).items()
                ],
            )
        )
    return PredictionScoreboard(records=records, scores=scores(records))


def scored(metric: str, estimate: dict[str, Any], realized: VsControl | None) -> PredictedMetric:
    """A predicted metric beside its realized difference (sign, interval, error)."""
    predicted = float(estimate["difference"])
    low, high = estimate.get("ci_low"), estimate.get("ci_high")
    diagnostics = estimate.get("diagnostics", {})
    fields: dict[str, Any] = {
        "metric": metric,
        "predicted": predicted,
        "predicted_ci_low": low,
        "predicted_ci_high": high,
        "reliable": bool(estimate.get("reliable")),
        "unreliable": list(diagnostics.get("unreliable", [])),
        "effective_samples": float(diagnostics.get("effective_samples", 0.0)),
        "pareto_k": diagnostics.get("pareto_k"),
        "realized": None,
        "realized_ci_low": None,
        "realized_ci_high": None,
        "sign_agrees": None,
        "realized_in_interval": None,
        "consistent": None,
        "error": None,
    }
    if realized is None:
        return PredictedMetric(**fields)
    actual = realized.difference
    fields |= {
        "realized": actual,
        "realized_ci_low": realized.ci_low,
        "realized_ci_high": realized.ci_high,
        "sign_agrees": math.copysign(1, predicted) == math.copysign(1, actual),
        "realized_in_interval": (
            low <= actual <= high if low is not None and high is not None else None
        ),
        "error": predicted - actual,
    }
    predicted_se = estimate.get("standard_error")
    if predicted_se is not None and realized.ci_low is not None and realized.ci_high is not None:
        realized_se = (realized.ci_high - realized.ci_low) / (2 * _Z)
        combined = math.sqrt(predicted_se**2 + realized_se**2)
        fields["consistent"] = abs(predicted - actual) <= _Z * combined
    return PredictedMetric(**fields)


def scores(records: Sequence[PredictionRecord]) -> list[PredictionScore]:
    """Per metric: sign agreement, interval coverage, consistency and error of the reliable
    predictions whose canary realized a difference."""
    by_metric: dict[str, list[PredictedMetric]] = {}
    for record in records:
        for metric in record.metrics:
            if metric.realized is not None:
                by_metric.setdefault(metric.metric, []).append(metric)
    result = []
    for name, metrics in sorted(by_metric.items()):
        reliable = [m for m in metrics if m.reliable]
        result.append(
            PredictionScore(
                metric=name,
                compared=len(reliable),
                unreliable_share=1 - len(reliable) / len(metrics),
                sign_agreement=_share([m.sign_agrees for m in reliable]),
                realized_in_interval=_share([m.realized_in_interval for m in reliable]),
                consistent=_share([m.consistent for m in reliable]),
                mean_abs_error=(
                    sum(abs(m.error or 0.0) for m in reliable) / len(reliable) if reliable else None
                ),
            )
        )
    return result


def _share(flags: Sequence[bool | None]) -> float | None:
    known = [flag for flag in flags if flag is not None]
    return sum(known) / len(known) if known else None


def _treatment_vs_control(results: ExperimentResults | None, metric: str) -> VsControl | None:
    if results is None:
        return None
    treatment = next((arm for arm in results.arms if not arm.is_control), None)
    if treatment is None or metric not in treatment.metrics:
        return None
    return treatment.metrics[metric].vs_control


async def _name(session: AsyncSession, checkpoint_id: int | None) -> str | None:
    if checkpoint_id is None:
        return None
    return await session.scalar(select(Checkpoint.name).where(Checkpoint.id == checkpoint_id))


async def _canary_of(session: AsyncSession, checkpoint_id: int | None) -> int | None:
    """The experiment whose treatment arm served the checkpoint (its canary), if any."""
    if checkpoint_id is None:
        return None
    return await session.scalar(
        select(Experiment.id)
        .join(Arm, Arm.experiment_id == Experiment.id)
        .where(Arm.checkpoint_id == checkpoint_id, Arm.is_control.is_(False))
        .order_by(Experiment.id)
        .limit(1)
    )


assert CONFIDENCE == 0.95  # _Z is its quantile
