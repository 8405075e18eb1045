"""Browser sessions for the dashboard: a random id in the cookie, the key's hash in Redis.

The cookie never holds the API key. A session expires after `SESSION_SECONDS`, ends at
logout, and every session of a key ends when the key is revoked. A key holds at most
`SESSIONS_PER_KEY` sessions: signing in once more ends its oldest, so Redis keeps at most that
many per key however often a script signs in.
"""

from __future__ import annotations

import secrets
import time
import uuid

from redis.asyncio import Redis

SESSION_SECONDS = 8 * 3600
SESSIONS_PER_KEY = 16


def _session_key(session_id: str) -> str:
    return f"rtrl:dash:s:{session_id}"


def _sessions_of(key_id: uuid.UUID) -> str:
    """A key's sessions, scored by when they opened."""
    return f"rtrl:dash:keys:{key_id}"


def _unordered_sessions_of(key_id: uuid.UUID) -> str:
    """The set earlier releases kept (unbounded); read only to end its sessions, and gone
    within `SESSION_SECONDS` of an upgrade."""
    return f"rtrl:dash:k:{key_id}"


class BrowserSessions:
    """Dashboard sessions kept in Redis, shared by every gateway replica."""

    def __init__(
        self, redis: Redis, ttl_s: int = SESSION_SECONDS, per_key: int = SESSIONS_PER_KEY
    ) -> None:
        self.redis = redis
        self.ttl_s = ttl_s
        self.per_key = per_key

    async def open(self, key_id: uuid.UUID, key_hash: str) -> str:
        """A new session of the key, ending its oldest past `per_key`; its id goes into the
        cookie."""
        session_id = secrets.token_urlsafe(32)
        sessions = _sessions_of(key_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(_session_key(session_id), key_hash, ex=self.ttl_s)
            pipe.zadd(sessions, {session_id: time.time()})
            pipe.expire(sessions, self.ttl_s)
            await pipe.execute()
        # Every open trims to the newest `per_key`: what two opens at once both keep is
        # trimmed by the next.
        oldest = await self.redis.zrange(sessions, 0, -(self.per_key + 1))
        if oldest:
            ended = [m.decode() if isinstance(m, bytes) else str(m) for m in oldest]
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.delete(*(_session_key(i) for i in ended))
                pipe.zrem(sessions, *ended)
                await pipe.execute()
        return session_id

    async def count(self, key_id: uuid.UUID) -> int:
        """The key's sessions Redis holds (expired ones included until their key's next
        sign-in trims them, or the set expires)."""
        return int(await self.redis.zcard(_sessions_of(key_id)))

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
        members = [
            *await self.redis.zrange(_sessions_of(key_id), 0, -1),
            *await self.redis.smembers(_unordered_sessions_of(key_id)),
        ]
        ids = [m.decode() if isinstance(m, bytes) else str(m) for m in members]
        await self.redis.delete(
            *(_session_key(i) for i in ids), _sessions_of(key_id), _unordered_sessions_of(key_id)
        )
