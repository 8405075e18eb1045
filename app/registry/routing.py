"""Routing changes: one lock serialises them, and one Redis channel announces them.

Every gateway subscribes to `ROUTING_CHANNEL` and reloads its routing table (production,
experiments, arms) when told; without Redis it catches up on its timer.
"""

from __future__ import annotations

from redis import Redis as SyncRedis
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.orm import Session

ROUTING_LOCK = {"namespace": 0x7274726C, "key": -2}
ROUTING_CHANNEL = "rtrl:routing"


def lock_routing(session: Session) -> None:
    """Serialise changes to routing until the transaction ends."""
    session.execute(text("SELECT pg_advisory_xact_lock(:namespace, :key)"), ROUTING_LOCK)


def notify_routing_changed_sync(redis_url: str) -> None:
    """`notify_routing_changed` for processes without an event loop (trainer, demo, workers)."""
    client = SyncRedis.from_url(redis_url)
    try:
        client.publish(ROUTING_CHANNEL, "changed")
    finally:
        client.close()


async def notify_routing_changed(redis: Redis) -> None:
    """Tell every gateway to reload its routing table (experiments, arms, checkpoint states)."""
    await redis.publish(ROUTING_CHANNEL, "changed")
