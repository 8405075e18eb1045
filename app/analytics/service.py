"""Analytics reads: experiment results with statistics, trends, alerts, lineage, exports."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from app.abtest import stats
from app.abtest.repository import (
    RATIOS,
    SAMPLE_EXPORT_COLUMNS,
    ArmSummary,
    Bucket,
    Moments,
    WeightPeriod,
    arm_reads,
    arm_summaries,
    sample_export_query,
    timeseries_query,
    weight_history_query,
    weight_periods,
)
from app.abtest.rollups import MAX_AGE, refresh_rollups, rollup_age
from app.analytics.schemas import (
    ArmBrief,
    ArmResult,
    CheckpointSeries,
    ExperimentBrief,
    ExperimentResults,
    LineageNode,
    Metric,
    MetricKind,
    SampleRatioCheck,
    TimeBucket,
    TimeSeries,
    TrainingRunBrief,
    VsControl,
    Window,
)
from app.models import Alert, Checkpoint, Experiment, TrainingRun

EXPORT_BATCH_ROWS = 2_000
QUANTILES: dict[str, tuple[float, float]] = {
    # name: (fraction, bandwidth h of the sparsity estimate (Q(p+h) - Q(p-h)) / 2h)
    "latency_p50_ms": (0.50, 0.02),
    "latency_p95_ms": (0.95, 0.01),
    "latency_p99_ms": (0.99, 0.004),
}


class ExperimentNotFound(LookupError):
    """No experiment has this id."""


async def read_only(session: AsyncSession) -> None:
    """Make the session's transaction read-only: analytics never writes."""
    await session.execute(text("SET TRANSACTION READ ONLY"))


async def experiment_briefs(
    session: AsyncSession, experiment_id: int | None = None
) -> list[ExperimentBrief]:
    """Experiments (newest first) with their arms and the checkpoints the arms serve."""
    query = select(Experiment).options(selectinload(Experiment.arms)).order_by(Experiment.id.desc())
    if experiment_id is not None:
        query = query.where(Experiment.id == experiment_id)
    experiments = (await session.scalars(query)).all()
    rows = await session.execute(select(Checkpoint.id, Checkpoint.name))
    names = {row.id: row.name for row in rows}
    return [
        ExperimentBrief(
            id=experiment.id,
            name=experiment.name,
            route=experiment.route,
            status=experiment.status.value,
            started_at=experiment.started_at,
            stopped_at=experiment.stopped_at,
            arms=[
                ArmBrief(
                    name=arm.name,
                    checkpoint=names[arm.checkpoint_id],
                    weight_bps=arm.weight_bps,
                    is_control=arm.is_control,
                )
                for arm in experiment.arms
            ],
        )
        for experiment in experiments
    ]


async def refresh_if_stale(
    session_maker: async_sessionmaker[AsyncSession], max_age: timedelta = MAX_AGE
) -> None:
    """Bring the rollups up to date first when they are older than `max_age`."""
    async with session_maker() as session:
        age = await session.run_sync(lambda sync: rollup_age(sync.connection()))
        if age is None or age > max_age:
            await session.run_sync(lambda sync: refresh_rollups(sync.connection()))
        await session.commit()


def whole_days(window: Window) -> Window:
    """The window widened to whole UTC days, the resolution of per-arm results."""
    since = window.since and _day_start(window.since)
    until = window.until and _day_start(window.until)
    if until is not None and window.until is not None and until < window.until:
        until += timedelta(days=1)
    return Window(since=since, until=until)


def whole_hours(window: Window) -> Window:
    """The window widened to whole UTC hours, the resolution of the rollups."""
    since = window.since and window.since.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    until = window.until and window.until.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    if until is not None and window.until is not None and until < window.until:
        until += timedelta(hours=1)
    return Window(since=since, until=until)


def _day_start(moment: datetime) -> datetime:
    return moment.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


async def experiment_results(
    session: AsyncSession, experiment_id: int, window: Window, cuped: bool = False
) -> ExperimentResults:
    """Per-arm metrics of an experiment over whole days, each compared with the control arm
    over users; with `cuped`, also adjusted for each user's pre-experiment values."""
    briefs = await experiment_briefs(session, experiment_id)
    if not briefs:
        raise ExperimentNotFound(f"Experiment {experiment_id} does not exist.")
    brief = briefs[0]
    days = whole_days(window)
    ramps = (await session.execute(weight_history_query(experiment_id))).all()
    periods = weight_periods(ramps, {arm.name: arm.weight_bps for arm in brief.arms})
    pre_until = brief.started_at.astimezone(UTC).date() if cuped and brief.started_at else None
    reads = arm_reads(
        experiment_id,
        days.since.date() if days.since else None,
        days.until.date() if days.until else None,
        ramps=[period.start for period in periods if period.start is not None],
        pre_until=pre_until,
    )
    summaries = await arm_summaries(session, reads)
    return build_results(brief, summaries, days, periods, cuped=pre_until is not None)


METRIC_KINDS: dict[str, MetricKind] = {
    "acceptance_rate": "proportion",
    "kept": "mean",
    "dissatisfied_rate": "proportion",
    "mean_reward": "mean",
    "edit_rate": "proportion",
    "malformed_call_rate": "proportion",
    "error_rate": "proportion",
    "latency_over_budget_rate": "proportion",
    "latency_mean_ms": "mean",
    "censored_edit_rate": "proportion",
    "latency_p50_ms": "percentile",
    "latency_p95_ms": "percentile",
    "latency_p99_ms": "percentile",
}


def build_results(
    experiment: ExperimentBrief,
    summaries: Sequence[ArmSummary],
    window: Window,
    periods: Sequence[WeightPeriod] = (),
    cuped: bool = False,
) -> ExperimentResults:
    """Results from per-arm summaries: values, comparisons with control, sample-ratio check."""
    arms = {arm.name: arm for arm in experiment.arms}
    control_name = next((arm.name for arm in experiment.arms if arm.is_control), None)
    by_arm = {summary.arm: summary for summary in summaries}
    order = [arm.name for arm in experiment.arms] + sorted(by_arm.keys() - arms.keys())
    control = by_arm.get(control_name) if control_name else None
    results = []
    for name in order:
        summary = by_arm.get(name) or ArmSummary(arm=name, moments=Moments())
        brief = arms.get(name)
        results.append(
            ArmResult(
                arm=name,
                checkpoint=brief.checkpoint if brief else None,
                is_control=name == control_name,
                weight_bps=brief.weight_bps if brief else None,
                users=summary.users,
                switched_users=summary.switched_users,
                requests=summary.requests,
                fallback_requests=summary.fallback_requests,
                metrics=arm_metrics(summary, None if name == control_name else control, cuped),
            )
        )
    current = {arm.name: arm.weight_bps for arm in experiment.arms}
    return ExperimentResults(
        experiment=experiment,
        since=window.since,
        until=window.until,
        confidence_level=stats.CONFIDENCE,
        cuped=cuped,
        control_arm=control_name,
        arms=results,
        sample_ratio=_sample_ratio(
            experiment.arms, by_arm, periods or [WeightPeriod(None, current)]
        ),
        metric_kinds=METRIC_KINDS,
    )


def arm_metrics(
    summary: ArmSummary, control: ArmSummary | None, cuped: bool = False
) -> dict[str, Metric]:
    """Each metric of one arm, with its comparison to control when there is a control."""
    metrics: dict[str, Metric] = {}
    for name in RATIOS:
        numerator, denominator = summary.ratio(name)
        versus = adjusted = None
        if control is not None:
            versus = _vs(stats.compare_metric(summary, control, name))
            if cuped:
                adjusted = _vs(stats.compare_metric(summary, control, name, cuped=True))
        metrics[name] = Metric(
            value=numerator / denominator if denominator else None,
            observations=int(denominator),
            vs_control=versus,
            cuped=adjusted,
        )
    for name, (fraction, bandwidth) in QUANTILES.items():
        estimate = stats.quantile_estimate(summary, fraction, bandwidth)
        comparison = None
        if control is not None:
            comparison = stats.compare_quantiles(
                estimate, stats.quantile_estimate(control, fraction, bandwidth)
            )
        metrics[name] = Metric(
            value=estimate.value if estimate else None,
            observations=sum(count for _, count in summary.latency_histogram),
            vs_control=_vs(comparison),
        )
    return metrics


def _vs(comparison: stats.Comparison | None) -> VsControl | None:
    if comparison is None:
        return None
    significant = (
        comparison.ci_low is not None
        and comparison.ci_high is not None
        and (comparison.ci_low > 0 or comparison.ci_high < 0)
    )
    return VsControl(
        difference=comparison.difference,
        relative_difference=comparison.relative_difference,
        ci_low=comparison.ci_low,
        ci_high=comparison.ci_high,
        relative_ci_low=comparison.relative_ci_low,
        relative_ci_high=comparison.relative_ci_high,
        p_value=comparison.p_value,
        significant=significant,
        variance_reduction=comparison.variance_reduction,
    )


def _sample_ratio(
    arms: Sequence[ArmBrief], by_arm: dict[str, ArmSummary], periods: Sequence[WeightPeriod]
) -> SampleRatioCheck | None:
    names = [arm.name for arm in arms]
    per_period = [
        (
            [by_arm[n].first_exposures.get(index, 0) if n in by_arm else 0 for n in names],
            [period.weights.get(n, 0) for n in names],
        )
        for index, period in enumerate(periods)
    ]
    check = stats.sample_ratio_mismatch(per_period)
    if check is None:
        return None
    total_weight = sum(arm.weight_bps for arm in arms) or 1
    return SampleRatioCheck(
        chi_square=check.chi_square if math.isfinite(check.chi_square) else None,
        p_value=check.p_value,
        mismatch=check.mismatch,
        threshold=stats.SRM_ALPHA,
        expected_share={arm.name: arm.weight_bps / total_weight for arm in arms},
        observed_users={
            n: sum(by_arm[n].first_exposures.values()) if n in by_arm else 0 for n in names
        },
        ramp_periods=len(periods),
    )


async def timeseries(
    session: AsyncSession, bucket: Bucket, checkpoints: list[str], window: Window
) -> TimeSeries:
    """Requests, kept rate, mean reward, dissatisfied rate and censored edit rate per checkpoint
    over time."""
    hours = whole_hours(window)
    rows = await session.execute(
        timeseries_query(bucket, checkpoints or None, hours.since, hours.until)
    )
    series: dict[str, list[TimeBucket]] = {}
    for row in rows:
        series.setdefault(row.checkpoint, []).append(
            TimeBucket(
                start=row.bucket_start,
                requests=int(row.requests),
                kept=row.kept,
                kept_observations=int(row.kept_n),
                mean_reward=row.mean_reward,
                reward_observations=int(row.reward_n),
                dissatisfied_rate=row.dissatisfied_rate,
                dissatisfied_observations=int(row.dissatisfied_n),
                censored_edit_rate=row.censored_edit_rate,
                edit_observations=int(row.edits_final),
            )
        )
    return TimeSeries(
        bucket=bucket,
        since=hours.since,
        until=hours.until,
        series=[CheckpointSeries(checkpoint=name, buckets=b) for name, b in series.items()],
    )


async def recent_alerts(session: AsyncSession, limit: int) -> list[Alert]:
    """The reward-hacking monitors' latest alerts."""
    query = select(Alert).order_by(Alert.created_at.desc(), Alert.id.desc()).limit(limit)
    return list((await session.scalars(query)).all())


async def lineage(session: AsyncSession) -> list[LineageNode]:
    """Every checkpoint with its parent, oldest first: the lineage tree."""
    checkpoints = (await session.scalars(select(Checkpoint).order_by(Checkpoint.id))).all()
    names = {checkpoint.id: checkpoint.name for checkpoint in checkpoints}
    return [
        LineageNode(
            name=checkpoint.name,
            parent=names.get(checkpoint.parent_id) if checkpoint.parent_id else None,
            status=checkpoint.status.value,
            published_at=checkpoint.published_at,
            promoted_at=checkpoint.promoted_at,
            retired_at=checkpoint.retired_at,
            superseded_by=(
                names.get(checkpoint.superseded_by_id) if checkpoint.superseded_by_id else None
            ),
        )
        for checkpoint in checkpoints
    ]


async def training_runs(session: AsyncSession, limit: int) -> list[TrainingRunBrief]:
    """The latest training runs, newest first, with their drift metrics."""
    runs = (
        await session.scalars(select(TrainingRun).order_by(TrainingRun.id.desc()).limit(limit))
    ).all()
    ids = {run.base_checkpoint_id for run in runs} | {run.output_checkpoint_id for run in runs}
    rows = await session.execute(
        select(Checkpoint.id, Checkpoint.name).where(Checkpoint.id.in_(ids - {None}))
    )
    names: dict[int | None, str] = {row.id: row.name for row in rows}
    briefs = []
    for run in runs:
        stats = run.stats or {}
        briefs.append(
            TrainingRunBrief(
                id=run.id,
                run_name=run.run_name,
                status=run.status.value,
                trigger=run.trigger.value if run.trigger else None,
                reason=run.reason,
                sample_count=run.sample_count,
                started_at=run.started_at,
                finished_at=run.finished_at,
                base_checkpoint=names.get(run.base_checkpoint_id),
                checkpoint=names.get(run.output_checkpoint_id),
                dtype=stats.get("dtype"),
                ranks=stats.get("ranks"),
                drift_tokens=stats.get("drift_tokens"),
                drift_mean_abs=stats.get("drift_mean_abs"),
                drift_max_abs=stats.get("drift_max_abs"),
                drift_kl=stats.get("drift_kl"),
                drift_capped_share=stats.get("drift_capped_share"),
            )
        )
    return briefs


RESULT_CSV_FIELDS = (
    *("value", "observations", "difference", "relative_difference"),
    *("ci_low", "ci_high", "p_value"),
)


def results_csv(results: ExperimentResults) -> str:
    """The per-arm table as CSV: one row per arm, seven columns per metric."""
    metric_names = list(results.metric_kinds)
    header = ["experiment_id", "arm", "checkpoint", "is_control", "weight_bps", "users"]
    header += ["switched_users", "requests", "fallback_requests"]
    header += [f"{metric}_{field}" for metric in metric_names for field in RESULT_CSV_FIELDS]
    rows: list[list[Any]] = []
    for arm in results.arms:
        row: list[Any] = [results.experiment.id, arm.arm, arm.checkpoint, arm.is_control]
        row += [arm.weight_bps, arm.users, arm.switched_users, arm.requests]
        row += [arm.fallback_requests]
        for metric_name in metric_names:
            metric = arm.metrics.get(metric_name)
            vs = metric.vs_control if metric else None
            row += [
                metric.value if metric else None,
                metric.observations if metric else 0,
                vs.difference if vs else None,
                vs.relative_difference if vs else None,
                vs.ci_low if vs else None,
                vs.ci_high if vs else None,
                vs.p_value if vs else None,
            ]
        rows.append(row)
    return _csv_text([header, *rows])


def _csv_text(rows: Iterable[Sequence[Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerows([["" if value is None else value for value in row] for row in rows])
    return buffer.getvalue()


async def sample_rows_csv(
    session_maker: async_sessionmaker[AsyncSession],
    experiment_id: int,
    arm: str | None,
    window: Window,
) -> AsyncIterator[str]:
    """Per-sample rows as CSV chunks, streamed from a server-side cursor."""
    yield _csv_text([[column.key for column in SAMPLE_EXPORT_COLUMNS]])
    query = sample_export_query(experiment_id, arm, window.since, window.until)
    async with session_maker() as session:
        await read_only(session)
        result = await session.stream(query.execution_options(yield_per=EXPORT_BATCH_ROWS))
        async for rows in result.partitions():
            yield _csv_text(
                [
                    [value.isoformat() if hasattr(value, "isoformat") else value for value in row]
                    for row in rows
                ]
            )
