"""API keys: issue them, authenticate them (cached for seconds), and meter them in Redis."""

from __future__ import annotations

import hashlib
import secrets
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

from redis.asyncio import Redis
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth.schemas import Principal
from app.models import ApiKey, Role

V = TypeVar("V")

SECRET_PREFIX = "rtrl_"
DISPLAY_PREFIX_CHARS = 12
AUTH_CACHE_TTL_S = 3.0
"""How long a key lookup is trusted, so a revocation takes effect within this time."""
AUTH_CACHE_MAX_ENTRIES = 10_000
UNKNOWN_KEY_TTL_S = 30.0
"""How long "no such key" is trusted: a key's secret is random, so an unknown one that later
becomes valid does not happen; a revoked key is refused at once by the cache of known keys."""
AUTH_FAILURES_PER_MINUTE = 30
"""Failed authentications a client address may make per clock minute before it waits."""
AUTH_STALE_IF_ERROR_S = 600.0
"""While Postgres is unreachable, a key's last answer stands this long past its TTL, so the
gateway keeps serving known keys through a database restart (a revocation made during the
outage waits for Postgres to return)."""


class AuthError(Exception):
    """The presented key is missing, unknown, revoked or expired."""


class AuthThrottled(Exception):
    """The client failed to authenticate too often; it may try again after `retry_after_s`."""

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(f"too many failed authentications; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class AuthUnavailable(Exception):
    """The key could not be checked: Postgres is unreachable and no recent answer is cached."""


def hash_secret(secret: str) -> str:
    """The SHA-256 hex digest stored for a key's secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def new_api_key(
    *,
    name: str,
    role: Role,
    privacy_mode: bool = False,
    rate_limit_per_minute: int | None = None,
    expires_at: datetime | None = None,
    created_by: str | None = None,
) -> tuple[ApiKey, str]:
    """A new key row (not yet added to a session) and its secret, which is never stored."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        name=name,
        role=role,
        key_prefix=secret[:DISPLAY_PREFIX_CHARS],
        key_hash=hash_secret(secret),
        privacy_mode=privacy_mode,
        rate_limit_per_minute=rate_limit_per_minute,
        expires_at=expires_at,
        created_by=created_by,
    )
    return row, secret


async def create_api_key(
    session: AsyncSession,
    *,
    name: str,
    role: Role,
    privacy_mode: bool = False,
    rate_limit_per_minute: int | None = None,
    expires_at: datetime | None = None,
    created_by: str | None = None,
) -> tuple[ApiKey, str]:
    """Add a new key to the session and flush; the secret is returned once, here."""
    row, secret = new_api_key(
        name=name,
        role=role,
        privacy_mode=privacy_mode,
        rate_limit_per_minute=rate_limit_per_minute,
        expires_at=expires_at,
        created_by=created_by,
    )
    session.add(row)
    await session.flush()
    return row, secret


def _principal(row: ApiKey) -> Principal:
    return Principal(
        key_id=row.id,
        name=row.name,
        role=row.role,
        privacy_mode=row.privacy_mode,
        rate_limit_per_minute=row.rate_limit_per_minute,
        expires_at=row.expires_at,
    )


class Authenticator:
    """Resolves secrets to principals, caching each answer (even "no such key") for seconds.

    Unknown keys are remembered apart from known ones, so a flood of them cannot push the
    known keys out; each client address may fail only so often before it waits.
    """

    def __init__(
        self,
        session_maker: async_sessionmaker[AsyncSession],
        *,
        ttl_s: float = AUTH_CACHE_TTL_S,
        unknown_ttl_s: float = UNKNOWN_KEY_TTL_S,
        max_entries: int = AUTH_CACHE_MAX_ENTRIES,
        stale_if_error_s: float = AUTH_STALE_IF_ERROR_S,
        failures_per_minute: int = AUTH_FAILURES_PER_MINUTE,
    ) -> None:
        self._session_maker = session_maker
        self._ttl_s = ttl_s
        self._unknown_ttl_s = unknown_ttl_s
        self._stale_if_error_s = stale_if_error_s
        self._max_entries = max_entries
        self._known: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._failures = FailureWindow(failures_per_minute, max_entries)
        self.lookups = 0
        """Postgres lookups made (the cost an unknown key's caller imposes)."""

    async def authenticate(self, secret: str, client: str | None = None) -> Principal:
        """The principal of a valid key; AuthError when unknown, revoked or expired.

        AuthThrottled, before any lookup, once `client` has failed too often this minute,
        unless the key is one this replica already knows to be valid: others' failures from
        the same address (a NAT, a proxy not configured as trusted) never lock out a key in
        use. A valid key this replica has not seen yet waits with its address.
        """
        key_hash = hash_secret(secret) if secret.startswith(SECRET_PREFIX) else None
        if client is not None and not self._known_valid(key_hash):
            self._failures.check(client)
        try:
            if key_hash is None:
                raise AuthError("invalid API key")
            return await self.authenticate_hash(key_hash)
        except AuthError:
            if client is not None:
                self._failures.add(client)
            raise

    def _known_valid(self, key_hash: str | None) -> bool:
        """Valid at its last lookup, and looked up within `stale_if_error_s`: a key in use
        stays exempt from its address's failures between lookups, not only while its cached
        answer is fresh (a revoked one is still refused by the lookup it then gets)."""
        cached = self._known.get(key_hash) if key_hash is not None else None
        return (
            cached is not None
            and cached[1] is not None
            and cached[0] + self._stale_if_error_s > time.monotonic()
        )

    async def authenticate_hash(self, key_hash: str) -> Principal:
        """The principal of a key by its stored hash (a browser session holds only that)."""
        now = time.monotonic()
        if self._unknown.get(key_hash, 0.0) > now:
            raise AuthError("invalid or revoked API key")
        cached = self._known.get(key_hash)
        if cached is not None and cached[0] > now:
            principal: Principal | None = cached[1]
        else:
            try:
                principal = await self._lookup(key_hash)
            except (SQLAlchemyError, OSError) as exc:
                if cached is None or cached[0] + self._stale_if_error_s <= now:
                    raise AuthUnavailable(str(exc).splitlines()[0]) from exc
                principal = cached[1]  # the last answer stands while Postgres is away
            else:
                self._remember(key_hash, principal, now)
        if principal is None:
            raise AuthError("invalid or revoked API key")
        if principal.expires_at is not None and principal.expires_at <= datetime.now(UTC):
            raise AuthError("API key expired")
        return principal

    def forget(self, key_id: uuid.UUID | None = None) -> None:
        """Drop the cached answers for one key (a revocation), or for every key."""
        if key_id is None:
            self._known.clear()
            self._unknown.clear()
            return
        for key_hash in [h for h, (_, p) in self._known.items() if p.key_id == key_id]:
            del self._known[key_hash]

    async def _lookup(self, key_hash: str) -> Principal | None:
        self.lookups += 1
        async with self._session_maker() as session:
            row = await session.scalar(
                select(ApiKey).where(ApiKey.key_hash == key_hash, ApiKey.revoked_at.is_(None))
            )
            return None if row is None else _principal(row)

    def _remember(self, key_hash: str, principal: Principal | None, now: float) -> None:
        if principal is None:
            self._known.pop(key_hash, None)
            _bounded_put(self._unknown, key_hash, now + self._unknown_ttl_s, self._max_entries)
        else:
            self._unknown.pop(key_hash, None)
            _bounded_put(self._known, key_hash, (now + self._ttl_s, principal), self._max_entries)


def _bounded_put(cache: OrderedDict[str, V], key: str, value: V, max_entries: int) -> None:
    """Set `key` as the newest entry; the oldest go once the cache is full."""
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > max_entries:
        cache.popitem(last=False)


class FailureWindow:
    """Failed authentications per client address in the current clock minute (per replica)."""

    def __init__(self, per_minute: int, max_clients: int) -> None:
        self._per_minute = per_minute
        self._max_clients = max_clients
        self._window = 0
        self._counts: OrderedDict[str, int] = OrderedDict()

    def check(self, client: str) -> None:
        """AuthThrottled when `client` has used up this minute's failures."""
        now = time.time()
        self._roll(int(now // 60))
        if self._counts.get(client, 0) >= self._per_minute:
            raise AuthThrottled(max(1, int(60 - now % 60)))

    def add(self, client: str) -> None:
        self._roll(int(time.time() // 60))
        _bounded_put(self._counts, client, self._counts.get(client, 0) + 1, self._max_clients)

    def _roll(self, window: int) -> None:
        if window != self._window:
            self._window = window
            self._counts.clear()


# One counter per key and clock minute; INCRBY and its expiry in one round trip.
_TAKE_FROM_WINDOW = """
local count = redis.call('INCRBY', KEYS[1], ARGV[1])
if count == tonumber(ARGV[1]) then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return count
"""
LEASES_PER_WINDOW = 60
"""A replica takes a key's allowance from Redis in slices of 1/60 of its limit, and
counts within a slice locally: one Redis call per slice instead of one per request. A
replica may leave up to one slice unused at the end of a minute."""


@dataclass(frozen=True, slots=True)
class RateDecision:
    allowed: bool
    limit: int
    retry_after_s: int


@dataclass(slots=True)
class _Lease:
    window: int
    left: int


class RateLimiter:
    """Per-key requests per clock minute, shared by every gateway replica through Redis."""

    WINDOW_MS = 60_000

    def __init__(self, redis: Redis, default_per_minute: int) -> None:
        self._redis = redis
        self._default = default_per_minute
        self._script = redis.register_script(_TAKE_FROM_WINDOW)
        self._leases: dict[uuid.UUID, _Lease] = {}

    async def check(self, principal: Principal) -> RateDecision:
        """Count one request against the key's allowance for the current minute."""
        limit = principal.rate_limit_per_minute or self._default
        now_ms = int(time.time() * 1000)
        window = now_ms // self.WINDOW_MS
        retry_after_s = max(1, -(-((window + 1) * self.WINDOW_MS - now_ms) // 1000))
        lease = self._leases.get(principal.key_id)
        if lease is None or lease.window != window:
            lease = self._leases[principal.key_id] = _Lease(window, 0)
        if lease.left == 0:
            granted = await self._take(principal, window, limit)
            if granted > 0:
                lease.left += granted
            elif lease.left == 0:
                lease.left = -1  # this minute's allowance is spent: no more Redis calls
        if lease.left < 0:
            return RateDecision(allowed=False, limit=limit, retry_after_s=retry_after_s)
        lease.left -= 1
        return RateDecision(allowed=True, limit=limit, retry_after_s=retry_after_s)

    async def _take(self, principal: Principal, window: int, limit: int) -> int:
        """Take the next slice of this minute's allowance; 0 or less when none is left."""
        size = max(1, limit // LEASES_PER_WINDOW)
        key = f"rtrl:rate:{principal.key_id}:{window}"
        taken = int(await self._script(keys=[key], args=[size, 2 * self.WINDOW_MS]))
        return min(size, limit - (taken - size))
