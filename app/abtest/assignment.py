"""A/B assignment: which checkpoint answers a user, from the running experiment's arms.

Buckets are GrowthBook's v2 hash of the experiment's salt and the user's hash, so every
gateway replica puts a user in the same arm with no coordination; arms hold the bucket ranges
`app.registry.buckets` lays out, so a ramp moves users only from control into the growing
treatment. The routing table is
read from Postgres (`load_routing_table`); the gateway caches it (`app.gateway.routing_cache`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import selectinload

from app.models import Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from app.registry.buckets import BUCKETS, ArmWeight, Ranges, arm_ranges
from app.serving.publish import BASE_CHECKPOINT

log = logging.getLogger(__name__)

CHAT_ROUTE = "chat"

_FNV_OFFSET = 0x811C9DC5
_FNV_PRIME = 0x01000193


def fnv1a32(text: str) -> int:
    """32-bit FNV-1a of the UTF-8 bytes."""
    value = _FNV_OFFSET
    for byte in text.encode():
        value = ((value ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return value


@functools.lru_cache(maxsize=65_536)
def bucket_bps(salt: str, unit: str) -> int:
    """The unit's bucket in 0..9999 (GrowthBook v2: fnv1a32(str(fnv1a32(salt + unit))))."""
    return fnv1a32(str(fnv1a32(salt + unit))) % BUCKETS


def hash_user(secret: str, user_id: str) -> str:
    """The keyed hash stored for a user and used as the unit of assignment."""
    return hmac.new(secret.encode(), user_id.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class ArmRoute:
    name: str
    checkpoint: str
    ranges: Ranges
    """The arm's buckets, [low, high) ranges (see `app.registry.buckets`)."""


@dataclass(frozen=True, slots=True)
class ExperimentRoute:
    id: int
    salt: str
    arms: tuple[ArmRoute, ...]

    def arm_for(self, user_hash: str) -> ArmRoute | None:
        """The arm whose bucket range holds the user, or None in the unallocated rest."""
        bucket = bucket_bps(self.salt, user_hash)
        for arm in self.arms:
            if any(low <= bucket < high for low, high in arm.ranges):
                return arm
        return None


@dataclass(frozen=True, slots=True)
class Assignment:
    """What serves one request; `fallback` when the arm's checkpoint was not being served."""

    checkpoint: str
    experiment_id: int | None = None
    arm: str | None = None
    fallback: bool = False
    unserved: str | None = None
    """With `fallback`: the arm's checkpoint that production stood in for."""


@dataclass(frozen=True, slots=True)
class RoutingTable:
    production: str = BASE_CHECKPOINT
    experiment: ExperimentRoute | None = None

    def assign(self, user_hash: str, served: frozenset[str] | None = None) -> Assignment:
        """The user's checkpoint; production outside the experiment or when the arm's is down."""
        if self.experiment is None:
            return Assignment(self.production)
        arm = self.experiment.arm_for(user_hash)
        if arm is None:
            return Assignment(self.production)
        if served is not None and arm.checkpoint not in served:
            return Assignment(
                self.production,
                self.experiment.id,
                arm.name,
                fallback=True,
                unserved=arm.checkpoint,
            )
        return Assignment(arm.checkpoint, self.experiment.id, arm.name)


async def load_routing_table(session: AsyncSession, route: str = CHAT_ROUTE) -> RoutingTable:
    """The production checkpoint and the route's running experiment, from Postgres."""
    production = await session.scalar(
        select(Checkpoint.name).where(Checkpoint.status == CheckpointStatus.production)
    )
    experiment = await session.scalar(
        select(Experiment)
        .where(Experiment.route == route, Experiment.status == ExperimentStatus.running)
        .options(selectinload(Experiment.arms))
    )
    experiment_route = None
    if experiment is not None:
        rows = await session.execute(
            select(Checkpoint.id, Checkpoint.name).where(
                Checkpoint.id.in_([arm.checkpoint_id for arm in experiment.arms])
            )
        )
        checkpoint_names = {row.id: row.name for row in rows}
        ranges = arm_ranges(
            [ArmWeight(arm.name, arm.weight_bps, arm.is_control) for arm in experiment.arms]
        )
        arms = tuple(
            ArmRoute(arm.name, checkpoint_names[arm.checkpoint_id], ranges[arm.name])
            for arm in experiment.arms
        )
        experiment_route = ExperimentRoute(experiment.id, experiment.salt, arms)
    return RoutingTable(production=production or BASE_CHECKPOINT, experiment=experiment_route)
