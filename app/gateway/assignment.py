"""A/B assignment: which checkpoint answers a user, from the running experiment's arms.

Buckets are GrowthBook's v2 hash of the experiment's salt and the user's hash, so every
gateway replica puts a user in the same arm with no coordination; arms hold the bucket ranges
`app.registry.buckets` lays out, so a ramp moves users only from control into the growing
treatment. The routing table is
read from Postgres, cached, reloaded when a `rtrl:routing` message arrives through Redis
and every `refresh_s` seconds as a safety net.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import hmac
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm import selectinload

from app.models import Checkpoint, CheckpointStatus, Experiment, ExperimentStatus
from app.registry.buckets import BUCKETS, ArmWeight, Ranges, arm_ranges
from app.registry.routing import ROUTING_CHANNEL
from app.serving.checkpoints import BASE_CHECKPOINT

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


@dataclass
class RoutingCache:
    """The routing table every request reads, kept fresh by Redis messages and a timer."""

    session_maker: async_sessionmaker[AsyncSession]
    redis: Redis
    refresh_s: float = 30.0
    table: RoutingTable = field(default_factory=RoutingTable)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _reload_wanted: asyncio.Event = field(default_factory=asyncio.Event)
    _stopping: bool = False

    async def start(self) -> None:
        """Load the table now, then follow changes in the background."""
        await self.reload()
        self._tasks = [
            asyncio.create_task(self._listen(), name="routing-listen"),
            asyncio.create_task(self._reload_loop(), name="routing-reload"),
        ]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop following changes; a reload in progress may finish, within `timeout_s`."""
        # Cancelling a query mid-flight can leave the async driver waiting forever, so the
        # reload loop is asked to stop rather than cancelled.
        self._stopping = True
        self._reload_wanted.set()
        for task in self._tasks:
            if task.get_name() == "routing-listen":
                task.cancel()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=timeout_s)
            for task in late:
                log.warning("routing task %s did not stop in time", task.get_name())
                task.cancel()
        self._tasks = []

    async def reload(self) -> None:
        """Read the table from Postgres now."""
        async with self.session_maker() as session:
            self.table = await load_routing_table(session)

    async def _reload_loop(self) -> None:
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reload_wanted.wait(), timeout=self.refresh_s)
            self._reload_wanted.clear()
            if self._stopping:
                return
            try:
                await self.reload()
            except Exception:
                log.warning("routing table reload failed; keeping the last one", exc_info=True)

    async def _listen(self) -> None:
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(ROUTING_CHANNEL)
                # Changes published while we were not subscribed are caught by this reload.
                self._reload_wanted.set()
                async for _message in pubsub.listen():
                    self._reload_wanted.set()
            except (RedisError, OSError):
                log.warning("routing notifications lost; resubscribing", exc_info=True)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(1.0)
