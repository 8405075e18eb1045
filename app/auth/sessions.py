"""Browser sessions for the dashboard: a random id in the cookie, the key's hash in Redis.

The cookie never holds the API key. A session expires after `SESSION_SECONDS`, ends at
logout, and every session of a key ends when the key is revoked.
"""

from __future__ import annotations

import secrets
import uuid

from redis.asyncio import Redis

SESSION_SECONDS = 8 * 3600


def _session_key(session_id: str) -> str:
    return f"rtrl:dash:s:{session_id}"


def _sessions_of(key_id: uuid.UUID) -> str:
    return f"rtrl:dash:k:{key_id}"


class BrowserSessions:
    """Dashboard sessions kept in Redis, shared by every gateway replica."""

    def __init__(self, redis: Redis, ttl_s: int = SESSION_SECONDS) -> None:
        self.redis = redis
        self.ttl_s = ttl_s

    async def open(self, key_id: uuid.UUID, key_hash: str) -> str:
        """A new session of the key; its id goes into the cookie."""
        session_id = secrets.token_urlsafe(32)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(_session_key(session_id), key_hash, ex=self.ttl_s)
            pipe.sadd(_sessions_of(key_id), session_id)
            pipe.expire(_sessions_of(key_id), self.ttl_s)
            await pipe.execute()
        return session_id

    async def key_hash(self, session_id: str) -> str | None:
        """The hash of the session's key, or None when it expired, ended or never was."""
        if not session_id or len(session_id) > 64:
            return None
        found = await self.redis.get(_session_key(session_id))
        return found.decode() if isinstance(found, bytes) else found

    async def close(self, session_id: str) -> None:
        await self.redis.delete(_session_key(session_id))

    async def end_all(self, key_id: uuid.UUID) -> None:
        """End every session of a key (it was revoked)."""
        members = await self.redis.smembers(_sessions_of(key_id))
        ids = [m.decode() if isinstance(m, bytes) else m for m in members]
        await self.redis.delete(*(_session_key(i) for i in ids), _sessions_of(key_id))
