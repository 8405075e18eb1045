"""The gateway's copy of the routing table: read from Postgres, reloaded when a `rtrl:routing`
message arrives through Redis and every `refresh_s` seconds as a safety net."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.abtest.assignment import RoutingTable, load_routing_table
from app.registry.routing import ROUTING_CHANNEL

log = logging.getLogger(__name__)


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
