"""`/analytics/*`: read-only experiment results, trends, alerts and exports for analysts."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from sqlalchemy.ext.asyncio import AsyncSession

from app.abtest.repository import Bucket
from app.analytics import service
from app.analytics.dependencies import analyst, read_only_session, window
from app.analytics.exports import ExportResponse
from app.analytics.schemas import (
    ARM_NAME,
    CHECKPOINT_NAME,
    AlertOut,
    ExperimentBrief,
    ExperimentResults,
    LineageNode,
    PredictionScoreboard,
    TimeSeries,
    TrainingRunBrief,
    Window,
)
from app.analytics.scoreboard import prediction_scoreboard
from app.http.errors import ApiError
from app.http.state import app_state

router = APIRouter(prefix="/analytics", tags=["analytics"], dependencies=[Depends(analyst)])

Session = Annotated[AsyncSession, Depends(read_only_session)]
TimeWindow = Annotated[Window, Depends(window)]
ExperimentId = Annotated[int, Path(ge=1, le=2**31 - 1)]


@router.get("/experiments", response_model=list[ExperimentBrief])
async def list_experiments(session: Session) -> list[ExperimentBrief]:
    """Every experiment, newest first, with its arms."""
    return await service.experiment_briefs(session)


@router.get("/experiments/{experiment_id}/results", response_model=ExperimentResults)
async def experiment_results(
    request: Request,
    experiment_id: ExperimentId,
    session: Session,
    time_window: TimeWindow,
    cuped: bool = False,
) -> ExperimentResults:
    """Per-arm metrics, differences to control over users with 95% intervals and p-values,
    and SRM; `cuped=true` adds each comparison adjusted for users' pre-experiment values.

    The window is widened to whole UTC days; the response names the one used.
    """
    return await _results(request, session, experiment_id, time_window, cuped)


@router.get("/experiments/{experiment_id}/results.csv", response_class=PlainTextResponse)
async def experiment_results_csv(
    request: Request, experiment_id: ExperimentId, session: Session, time_window: TimeWindow
) -> PlainTextResponse:
    """The per-arm table as CSV."""
    results = await _results(request, session, experiment_id, time_window)
    return PlainTextResponse(
        service.results_csv(results),
        media_type="text/csv",
        headers=_attachment(f"experiment-{experiment_id}-results.csv"),
    )


@router.get("/experiments/{experiment_id}/samples.csv", response_class=StreamingResponse)
async def experiment_samples_csv(
    request: Request,
    experiment_id: ExperimentId,
    time_window: TimeWindow,
    arm: Annotated[str | None, Query(pattern=ARM_NAME)] = None,
) -> StreamingResponse:
    """One row per sample of the experiment (metrics only), streamed; a gateway streams at
    most `RTRL_EXPORT_STREAMS` at once (429 `too_many_exports` beyond), on a pool of their
    own."""
    exports = app_state(request.app).exports
    release = exports.take()
    try:
        async with exports.session_maker() as session:
            await service.read_only(session)
            if not await service.experiment_briefs(session, experiment_id):
                raise _not_found(experiment_id)
    except BaseException:
        release()
        raise
    return ExportResponse(
        service.sample_rows_csv(exports.session_maker, experiment_id, arm, time_window),
        release,
        headers=_attachment(f"experiment-{experiment_id}-samples.csv"),
    )


@router.get("/timeseries", response_model=TimeSeries)
async def checkpoint_timeseries(
    request: Request,
    session: Session,
    time_window: TimeWindow,
    bucket: Bucket = "day",
    checkpoint: Annotated[list[str], Query(max_length=50)] = [],  # noqa: B006
) -> TimeSeries:
    """Requests, kept rate, mean reward, dissatisfied rate and censored edit rate per checkpoint
    per hour or day."""
    await service.refresh_if_stale(app_state(request.app).session_maker)
    for name in checkpoint:
        if not _is_checkpoint_name(name):
            raise ApiError(400, f"Invalid checkpoint name {name!r}.", param="checkpoint")
    return await service.timeseries(session, bucket, checkpoint, time_window)


@router.get("/alerts", response_model=list[AlertOut])
async def alerts(
    session: Session, limit: Annotated[int, Query(ge=1, le=500)] = 50
) -> list[AlertOut]:
    """The reward-hacking monitors' latest alerts."""
    return [AlertOut.model_validate(alert) for alert in await service.recent_alerts(session, limit)]


@router.get("/lineage", response_model=list[LineageNode])
async def checkpoint_lineage(session: Session) -> list[LineageNode]:
    """Every checkpoint with its parent and status."""
    return await service.lineage(session)


@router.get("/training-runs", response_model=list[TrainingRunBrief])
async def training_runs(
    session: Session, limit: Annotated[int, Query(ge=1, le=500)] = 20
) -> list[TrainingRunBrief]:
    """The latest training runs with their outcome and serving/training drift."""
    return await service.training_runs(session, limit)


@router.get("/predictions", response_model=PredictionScoreboard)
async def predictions(
    request: Request, session: Session, limit: Annotated[int, Query(ge=1, le=200)] = 20
) -> PredictionScoreboard:
    """Each candidate's A/B as predicted from production's logs before its canary, beside
    what the canary realized (treatment minus control, over users), and per metric how often
    they agreed: sign, the realized difference inside the predicted interval, error."""
    await service.refresh_if_stale(app_state(request.app).session_maker)
    return await prediction_scoreboard(session, limit)


async def _results(
    request: Request,
    session: AsyncSession,
    experiment_id: int,
    time_window: Window,
    cuped: bool = False,
) -> ExperimentResults:
    await service.refresh_if_stale(app_state(request.app).session_maker)
    try:
        return await service.experiment_results(session, experiment_id, time_window, cuped)
    except service.ExperimentNotFound:
        raise _not_found(experiment_id) from None


def _not_found(experiment_id: int) -> ApiError:
    return ApiError(
        404,
        f"Experiment {experiment_id} does not exist.",
        type="not_found_error",
        code="experiment_not_found",
        param="experiment_id",
    )


def _is_checkpoint_name(name: str) -> bool:
    return re.fullmatch(CHECKPOINT_NAME, name) is not None


def _attachment(filename: str) -> dict[str, str]:
    return {"Content-Disposition": f'attachment; filename="{filename}"'}
