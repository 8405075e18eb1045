"""`/admin/*` for ops: what serves (promote, roll back, experiments), keys, training.

Every change commits with its audit entry, then tells every gateway replica through
Redis to reload its routing table, so it takes effect within seconds everywhere.
Refusals are answered in the gateway's error shape: 404 unknown target, 409 invalid
transition, 422 invalid values, 503 when a vLLM replica cannot load a checkpoint.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict
from datetime import UTC, datetime
from functools import partial
from typing import Annotated, TypeVar

import anyio
from fastapi import APIRouter, Body, Depends, Path, Query, Request
from redis.exceptions import RedisError
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from app.abtest.assignment import hash_user
from app.abtest.guardrails import GuardrailDecision, check_guardrails_in
from app.admin.schemas import (
    ApiKeyCreated,
    ApiKeyOut,
    ArmOut,
    Change,
    CheckpointDetail,
    CheckpointOut,
    ExperimentOut,
    Promotion,
    Ramp,
    Reason,
    TrainingRunOut,
    TrainingState,
    UserErased,
    UserErasure,
)
from app.auth import keys
from app.auth.schemas import ApiKeyCreate, Principal
from app.db import async_session_scope
from app.history import erasure as history_erasure
from app.history.archive import Archive
from app.http.dependencies import require_role
from app.http.errors import ApiError, ErrorType
from app.http.state import app_state
from app.models import Checkpoint, CheckpointStatus, Experiment, ExperimentStatus, Role
from app.registry import checkpoints, experiments, flags
from app.registry.audit import Actor, RegistryError, audit, audit_entries, audit_of
from app.registry.routing import notify_routing_changed
from app.registry.schedule import next_cycle_at
from app.registry.schemas import NAME, ExperimentCreate
from app.serving.replicas import serve_everywhere as load_everywhere

log = logging.getLogger(__name__)
A = TypeVar("A")
T = TypeVar("T")

router = APIRouter(prefix="/admin", tags=["admin"])

Ops = Annotated[Principal, Depends(require_role(Role.ops))]
CheckpointName = Annotated[str, Path(max_length=64, pattern=NAME)]
ExperimentId = Annotated[int, Path(ge=1, le=2**31 - 1)]
OptionalReason = Annotated[Reason | None, Body()]
_ERROR_TYPES: dict[int, ErrorType] = {404: "not_found_error", 409: "conflict_error"}


def actor_of(principal: Principal) -> Actor:
    return Actor(principal.name, principal.key_id)


@contextmanager
def refusals() -> Iterator[None]:
    """Refused changes and lost races, answered in the API's error shape."""
    try:
        yield
    except RegistryError as exc:
        raise ApiError(
            exc.status_code,
            exc.message,
            type=_ERROR_TYPES.get(exc.status_code, "invalid_request_error"),
            code=exc.code,
            param=exc.param,
        ) from None
    except IntegrityError as exc:
        # A concurrent change won the race for a unique index (one production, one running
        # experiment per route, unique names).
        raise ApiError(
            409,
            f"The change conflicts with the current state: {exc.orig}".strip(),
            type="conflict_error",
            code="conflict",
        ) from None


@asynccontextmanager
async def change(request: Request, *, routing: bool = True) -> AsyncIterator[AsyncSession]:
    """The transaction of one change; a routing change is announced once it is committed,
    so a gateway that reloads sees the new state."""
    with refusals():
        async with async_session_scope(app_state(request.app).session_maker) as session:
            yield session
    if routing:
        await announce(request)


@asynccontextmanager
async def reading(request: Request) -> AsyncIterator[AsyncSession]:
    """A session for reads; an unknown target is answered 404."""
    with refusals():
        async with app_state(request.app).session_maker() as session:
            yield session


async def _with_names(
    request: Request, query: Callable[[Session, A], T], argument: A
) -> tuple[T, dict[int, str]]:
    """What `query` reads, and the names of the checkpoints it refers to by id."""
    async with reading(request) as session:
        found = await session.run_sync(query, argument)
        names = await session.run_sync(checkpoints.checkpoint_names)
    return found, names


async def announce(request: Request) -> None:
    """Tell every gateway to reload routing; without Redis they catch up on their timer."""
    try:
        await notify_routing_changed(app_state(request.app).redis)
    except (RedisError, OSError):
        log.warning("routing change not announced: Redis unavailable", exc_info=True)


async def serve_everywhere(request: Request, checkpoint: Checkpoint) -> None:
    """Refuse (503) unless every vLLM replica serves the checkpoint, loading it where missing."""
    settings = app_state(request.app).settings
    failures = await anyio.to_thread.run_sync(
        partial(
            load_everywhere,
            checkpoint.name,
            checkpoint.adapter_path,
            settings.vllm_urls,
            api_key=settings.vllm_api_key.get_secret_value(),
        )
    )
    if failures:
        raise ApiError.service_unavailable(
            f"{checkpoint.name} cannot be served by every replica, so nothing changed: "
            + "; ".join(failures),
            code="replica_unavailable",
            retry_after_s=5,
        )


# -- checkpoints ---------------------------------------------------------------------------


def _checkpoint_out(checkpoint: Checkpoint, names: dict[int, str]) -> CheckpointOut:
    return CheckpointOut(
        name=checkpoint.name,
        status=checkpoint.status,
        parent=names.get(checkpoint.parent_id) if checkpoint.parent_id else None,
        base_model=checkpoint.base_model,
        adapter_path=checkpoint.adapter_path,
        reward_version=checkpoint.reward_version,
        published_at=checkpoint.published_at,
        promoted_at=checkpoint.promoted_at,
        retired_at=checkpoint.retired_at,
        superseded_by=(
            names.get(checkpoint.superseded_by_id) if checkpoint.superseded_by_id else None
        ),
        created_at=checkpoint.created_at,
    )


@router.get("/checkpoints", response_model=list[CheckpointOut])
async def list_checkpoints(
    request: Request, _: Ops, status: CheckpointStatus | None = None
) -> list[CheckpointOut]:
    """Every checkpoint, newest first, optionally of one status."""
    found, names = await _with_names(request, checkpoints.list_checkpoints, status)
    return [_checkpoint_out(checkpoint, names) for checkpoint in found]


@router.get("/checkpoints/{name}", response_model=CheckpointDetail)
async def checkpoint_detail(request: Request, _: Ops, name: CheckpointName) -> CheckpointDetail:
    """A checkpoint with its lineage, the training runs around it, its experiments and the
    audit log of both."""
    async with reading(request) as session:
        checkpoint = await session.run_sync(checkpoints.checkpoint_named, name)
        chain = await session.run_sync(checkpoints.lineage, checkpoint)
        produced, trained = await session.run_sync(checkpoints.training_runs_of, checkpoint)
        serving = await session.run_sync(experiments.experiments_serving, checkpoint.id)
        names = await session.run_sync(checkpoints.checkpoint_names)
        targets = [f"checkpoint:{name}", *(f"experiment:{e.id}" for e in serving)]
        entries = await session.run_sync(audit_of, targets, 100)
    return CheckpointDetail(
        **_checkpoint_out(checkpoint, names).model_dump(),
        lineage=[_checkpoint_out(ancestor, names) for ancestor in chain],
        produced_by=[TrainingRunOut.model_validate(run) for run in produced],
        trained_from=[TrainingRunOut.model_validate(run) for run in trained],
        experiments=[_experiment_out(experiment, names) for experiment in serving],
        audit=[Change.model_validate(entry) for entry in entries],
    )


@router.post("/checkpoints/{name}/promote", response_model=Change)
async def promote(
    request: Request,
    principal: Ops,
    name: CheckpointName,
    body: Annotated[Promotion | None, Body()] = None,
) -> Change:
    """Make a candidate or canary production (100% outside experiments); the previous
    production is retired and stays ready for a rollback. Refused (409 `monitor_alerts`)
    while the reward-hacking monitors have alerts on it, unless `override_alerts`."""
    body = body or Promotion()
    async with change(request) as session:
        entry = await session.run_sync(
            lambda sync: checkpoints.promote(
                sync,
                name,
                actor_of(principal),
                body.reason,
                override_alerts=body.override_alerts,
            )
        )
        await serve_everywhere(request, await session.run_sync(checkpoints.checkpoint_named, name))
    return Change.model_validate(entry)


@router.post("/checkpoints/{name}/rollback", response_model=Change)
async def rollback_checkpoint(
    request: Request, principal: Ops, name: CheckpointName, body: OptionalReason = None
) -> Change:
    """Roll back production (the previous production serves again) or a canary (its
    experiment stops)."""
    return await _rollback(request, principal, name, body)


@router.post("/rollback", response_model=Change)
async def rollback_production(
    request: Request, principal: Ops, body: OptionalReason = None
) -> Change:
    """Roll back whatever is production now to the production before it."""
    return await _rollback(request, principal, None, body)


async def _rollback(
    request: Request, principal: Principal, name: str | None, body: Reason | None
) -> Change:
    reason = body.reason if body else None
    async with change(request) as session:
        if name is None:
            entry = await session.run_sync(
                checkpoints.rollback_production, actor_of(principal), reason
            )
        else:
            entry = await session.run_sync(checkpoints.rollback, name, actor_of(principal), reason)
        production = (entry.after or {}).get("production")
        if production is not None:
            restored = await session.run_sync(checkpoints.checkpoint_named, production)
            await serve_everywhere(request, restored)
    return Change.model_validate(entry)


@router.get("/training-runs", response_model=list[TrainingRunOut])
async def training_runs(
    request: Request, _: Ops, limit: Annotated[int, Query(ge=1, le=500)] = 50
) -> list[TrainingRunOut]:
    """The latest training runs with their statistics and evaluation."""
    async with reading(request) as session:
        runs = await session.run_sync(checkpoints.recent_training_runs, limit)
    return [TrainingRunOut.model_validate(run) for run in runs]


# -- experiments ---------------------------------------------------------------------------


def _experiment_out(experiment: Experiment, names: dict[int, str]) -> ExperimentOut:
    return ExperimentOut(
        id=experiment.id,
        name=experiment.name,
        route=experiment.route,
        status=experiment.status,
        created_by=experiment.created_by,
        created_at=experiment.created_at,
        started_at=experiment.started_at,
        stopped_at=experiment.stopped_at,
        arms=[
            ArmOut(
                name=arm.name,
                checkpoint=names.get(arm.checkpoint_id, "?"),
                weight_bps=arm.weight_bps,
                is_control=arm.is_control,
            )
            for arm in experiment.arms
        ],
    )


@router.get("/experiments", response_model=list[ExperimentOut])
async def list_experiments(
    request: Request, _: Ops, status: ExperimentStatus | None = None
) -> list[ExperimentOut]:
    """Experiments, newest first, optionally of one status."""
    found, names = await _with_names(request, experiments.list_experiments, status)
    return [_experiment_out(experiment, names) for experiment in found]


@router.get("/experiments/{experiment_id}", response_model=ExperimentOut)
async def experiment(request: Request, _: Ops, experiment_id: ExperimentId) -> ExperimentOut:
    found, names = await _with_names(request, experiments.experiment_by_id, experiment_id)
    return _experiment_out(found, names)


@router.post("/experiments", response_model=ExperimentOut, status_code=201)
async def create_experiment(
    request: Request, principal: Ops, spec: ExperimentCreate
) -> ExperimentOut:
    """Create an experiment (a draft unless `start`); weights in basis points sum to 10000."""
    async with change(request, routing=spec.start) as session:
        created = await session.run_sync(experiments.create_experiment, spec, actor_of(principal))
        await session.refresh(created, ["created_at"])
        names = await session.run_sync(checkpoints.checkpoint_names)
    return _experiment_out(created, names)


@router.post("/experiments/{experiment_id}/start", response_model=Change)
async def start_experiment(request: Request, principal: Ops, experiment_id: ExperimentId) -> Change:
    """Start a draft; one running experiment per route."""
    async with change(request) as session:
        entry = await session.run_sync(
            experiments.start_experiment, experiment_id, actor_of(principal)
        )
    return Change.model_validate(entry)


@router.post("/experiments/{experiment_id}/ramp", response_model=Change)
async def ramp_experiment(
    request: Request, principal: Ops, experiment_id: ExperimentId, ramp: Ramp
) -> Change:
    """Change every arm's weight (basis points, summing to 10000)."""
    async with change(request) as session:
        entry = await session.run_sync(
            experiments.ramp_experiment, experiment_id, ramp.weights, actor_of(principal)
        )
    return Change.model_validate(entry)


@router.post("/experiments/{experiment_id}/stop", response_model=Change)
async def stop_experiment(
    request: Request, principal: Ops, experiment_id: ExperimentId, body: OptionalReason = None
) -> Change:
    """Stop an experiment: its users are served production again."""
    async with change(request) as session:
        entry = await session.run_sync(
            experiments.stop_experiment,
            experiment_id,
            actor_of(principal),
            body.reason if body else None,
        )
    return Change.model_validate(entry)


@router.post("/guardrails/check", response_model=list[GuardrailDecision])
async def check_guardrails(
    request: Request, principal: Ops, rollback: bool = False
) -> list[GuardrailDecision]:
    """Test every running canary's guardrail metrics; with `rollback=true`, roll back those
    significantly worse than control."""
    async with change(request, routing=rollback) as session:
        return await session.run_sync(check_guardrails_in, rollback=rollback)


# -- API keys ------------------------------------------------------------------------------


@router.get("/api-keys", response_model=list[ApiKeyOut])
async def list_api_keys(request: Request, _: Ops, include_revoked: bool = False) -> list[ApiKeyOut]:
    """API keys (never their secrets), newest first."""
    async with reading(request) as session:
        found = await keys.list_api_keys(session, include_revoked)
    return [ApiKeyOut.model_validate(key) for key in found]


@router.post("/api-keys", response_model=ApiKeyCreated, status_code=201)
async def create_api_key(request: Request, principal: Ops, spec: ApiKeyCreate) -> ApiKeyCreated:
    """A new API key; its secret is in this response only."""
    async with change(request, routing=False) as session:
        row, secret = await keys.issue_api_key(session, spec, actor_of(principal))
    return ApiKeyCreated(**ApiKeyOut.model_validate(row).model_dump(), secret=secret)


@router.post("/api-keys/{key_id}/revoke", response_model=Change)
async def revoke_api_key(request: Request, principal: Ops, key_id: uuid.UUID) -> Change:
    """Revoke a key: refused here at once, by other replicas within seconds."""
    async with change(request, routing=False) as session:
        entry = await keys.revoke_api_key(session, key_id, actor_of(principal))
    state = app_state(request.app)
    state.authenticator.forget(key_id)
    try:
        await state.browser_sessions.end_all(key_id)
    except RedisError:
        # The sessions stay, but authenticating through them fails with the revoked key.
        log.warning("dashboard sessions of %s not ended: Redis unavailable", key_id)
    return Change.model_validate(entry)


# -- training ------------------------------------------------------------------------------


@router.get("/training", response_model=TrainingState)
async def training_state(request: Request, _: Ops) -> TrainingState:
    """Whether training is paused, whether a cycle is requested, when the next scheduled
    cycle is due, and the latest runs."""
    async with reading(request) as session:
        paused = await session.run_sync(flags.flag, flags.TRAINING_PAUSED)
        requested = await session.run_sync(flags.flag, flags.CYCLE_REQUESTED)
        due = await session.run_sync(next_cycle_at)
        runs = await session.run_sync(checkpoints.recent_training_runs, 10)
    return TrainingState(
        paused=paused,
        cycle_requested=requested,
        next_cycle_at=due,
        recent_runs=[TrainingRunOut.model_validate(run) for run in runs],
    )


@router.post("/training/pause", response_model=Change)
async def pause_training(request: Request, principal: Ops, body: OptionalReason = None) -> Change:
    """Pause the trainer's cycles (one already running finishes)."""
    return await _set_paused(request, principal, True, body)


@router.post("/training/resume", response_model=Change)
async def resume_training(request: Request, principal: Ops, body: OptionalReason = None) -> Change:
    """Resume the trainer's cycles."""
    return await _set_paused(request, principal, False, body)


async def _set_paused(
    request: Request, principal: Principal, paused: bool, body: Reason | None
) -> Change:
    async with change(request, routing=False) as session:
        entry = await session.run_sync(
            flags.set_training_paused,
            paused,
            actor_of(principal),
            body.reason if body else None,
        )
        await session.flush()
    return Change.model_validate(entry)


@router.post("/training/cycle", response_model=Change)
async def request_cycle(request: Request, principal: Ops) -> Change:
    """Ask for one extra cycle now, which one trainer takes; the schedule stays as it is."""
    async with change(request, routing=False) as session:
        entry = await session.run_sync(flags.request_training_cycle, actor_of(principal))
        await session.flush()
    return Change.model_validate(entry)


@router.get("/audit", response_model=list[Change])
async def audit_log(
    request: Request,
    _: Ops,
    target: Annotated[str | None, Query(max_length=200)] = None,
    action: Annotated[str | None, Query(max_length=64)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> list[Change]:
    """The audit log, newest first: who changed what, the state before and after."""
    async with reading(request) as session:
        entries = await session.run_sync(audit_entries, target, action, limit)
    return [Change.model_validate(entry) for entry in entries]


# -- users ---------------------------------------------------------------------------------


@router.post("/users/erase", response_model=UserErased)
async def erase_user(request: Request, principal: Ops, body: UserErasure) -> UserErased:
    """Erase a user's samples, feedback and rewards from Postgres and the archive, take them
    out of the rollups, and keep their redelivered events and running training cycles from
    bringing them back."""
    settings = app_state(request.app).settings
    user_hash = hash_user(settings.user_hash_secret.get_secret_value(), body.user_id)
    now = datetime.now(UTC)
    try:
        archive = Archive.at(settings.history_archive_url)
        async with change(request, routing=False) as session:
            erased = await history_erasure.erase_user(session, archive, user_hash, now=now)
            entry = audit(
                session,
                actor_of(principal),
                "erase_user",
                f"user:{user_hash}",
                None,
                {**asdict(erased), "reason": body.reason},
            )
            await session.flush()
    except OSError as exc:
        raise ApiError.service_unavailable(
            f"The archive cannot be rewritten, so nothing was erased: {exc}",
            code="archive_unavailable",
            retry_after_s=60,
        ) from None
    return UserErased(user_hash=user_hash, erased_at=now, audit_id=entry.id, **asdict(erased))
